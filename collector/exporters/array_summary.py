"""The forwarded copy of a trace with its long token arrays summarised (``--forward-max-array-bytes``).

Trace back ends cut long attributes: Grafana Tempo truncates any attribute over
``max_attribute_bytes`` (2,048 by default), and a request of a few hundred tokens carries more than
that in ``llm.token_event.offsets_ns``. The collector derives from the whole arrays either way;
this changes only what it forwards. In the forwarded copy, each of otel-llm's integer arrays whose
text (``[1,2,3]``) is longer than the limit is replaced by its summary, beside the other attributes:

* a time array (``*.offsets_ns``, ns after the span's start): ``<key>.count``, ``.first``, ``.last``
  and ``.max_gap`` (the largest difference between neighbours; 0 for fewer than two);
* a count array (``*.tokens``): ``<key>.count`` and ``.sum``.

An array's partner (the offsets and the tokens of the same events) is summarised with it, so a
span never carries one without the other. Arrays within the limit, and every other attribute, are
forwarded as they came. The body is parsed and written again only where an array is replaced.
"""

from __future__ import annotations

from itertools import pairwise

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from otel_llm import semconv as sc

#: the arrays summarised, and how: "times" (count, first, last, max_gap) or "counts" (count, sum)
ARRAYS = {
    sc.TOKEN_EVENT_OFFSETS: "times",
    sc.TOKEN_GENERATED_OFFSETS: "times",
    sc.HTTP_CHUNK_OFFSETS: "times",
    sc.TOKEN_EVENT_TOKENS: "counts",
    sc.TOKEN_GENERATED_TOKENS: "counts",
}
#: the arrays that describe the same events: summarised together
PARTNER = {
    sc.TOKEN_EVENT_OFFSETS: sc.TOKEN_EVENT_TOKENS,
    sc.TOKEN_EVENT_TOKENS: sc.TOKEN_EVENT_OFFSETS,
    sc.TOKEN_GENERATED_OFFSETS: sc.TOKEN_GENERATED_TOKENS,
    sc.TOKEN_GENERATED_TOKENS: sc.TOKEN_GENERATED_OFFSETS,
}
_ARRAY_KEYS = tuple(k.encode() for k in ARRAYS)


def text_bytes(values: list[int]) -> int:
    """The length of ``values`` written as a back end shows an array: ``[1,2,3]``."""
    return 2 + max(len(values) - 1, 0) + sum(len(str(v)) for v in values)


def summary(key: str, values: list[int]) -> list[KeyValue]:
    """The summary attributes of one array (see the module docstring)."""
    out = {f"{key}.count": len(values)}
    if ARRAYS[key] == "times":
        gaps = [b - a for a, b in pairwise(values)]
        out[f"{key}.first"] = values[0] if values else 0
        out[f"{key}.last"] = values[-1] if values else 0
        out[f"{key}.max_gap"] = max(gaps, default=0)
    else:
        out[f"{key}.sum"] = sum(values)
    return [KeyValue(key=k, value=AnyValue(int_value=v)) for k, v in out.items()]


def summarise(body: bytes, max_bytes: int) -> bytes:
    """``body`` (a serialized ExportTraceServiceRequest) with every array of :data:`ARRAYS` longer
    than ``max_bytes`` as text replaced by its summary; ``body`` itself where none is."""
    if not any(k in body for k in _ARRAY_KEYS):  # cheap: most bodies (phases, steps) carry none
        return body
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    changed = False
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                arrays = {
                    kv.key: [v.int_value for v in kv.value.array_value.values]
                    for kv in span.attributes
                    if kv.key in ARRAYS and kv.value.WhichOneof("value") == "array_value"
                }
                long = {k for k, v in arrays.items() if text_bytes(v) > max_bytes}
                long |= {PARTNER[k] for k in long if PARTNER.get(k) in arrays}
                if not long:
                    continue
                changed = True
                keep = [kv for kv in span.attributes if kv.key not in long]
                added = [a for k in arrays if k in long for a in summary(k, arrays[k])]
                del span.attributes[:]
                span.attributes.extend(keep + added)
    return req.SerializeToString() if changed else body
