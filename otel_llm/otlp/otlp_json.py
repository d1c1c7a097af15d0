"""OTLP/JSON encoding of trace export requests, as the OpenTelemetry Collector's file exporter
writes it: lowerCamelCase keys, enums as integers, 64-bit integers as decimal strings, and trace
and span ids as **hex** (not protobuf-JSON base64).
"""

from __future__ import annotations

import base64
import json

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _dicts(obj, key: str):
    """The dicts in ``obj[key]`` when it is a list (tolerates any shape: input may be hostile)."""
    v = obj.get(key) if isinstance(obj, dict) else None
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def _walk_spans(d: dict):
    for rs in _dicts(d, "resourceSpans"):
        for ss in _dicts(rs, "scopeSpans"):
            for span in _dicts(ss, "spans"):
                yield span
                yield from _dicts(span, "links")


def _map_ids(d: dict, fn) -> dict:
    for obj in _walk_spans(d):
        for k in _ID_KEYS:
            if obj.get(k):
                obj[k] = fn(obj[k])
    return d


def to_dict(req: ExportTraceServiceRequest) -> dict:
    d = json_format.MessageToDict(req, use_integers_for_enums=True)
    return _map_ids(d, lambda b64: base64.b64decode(b64).hex())


def to_json(req: ExportTraceServiceRequest) -> str:
    """One line of OTLP JSON (no newline)."""
    return json.dumps(to_dict(req), separators=(",", ":"))


def from_dict(d: dict) -> ExportTraceServiceRequest:
    """Parse OTLP/JSON (hex ids) into a protobuf request; raises ValueError on malformed input."""
    if not isinstance(d, dict):
        raise ValueError("OTLP JSON must be an object")

    def hex_to_b64(h):
        if not isinstance(h, str):
            raise ValueError("trace and span ids must be hex strings")
        try:
            return base64.b64encode(bytes.fromhex(h)).decode()
        except ValueError:
            raise ValueError(f"bad hex id {h[:40]!r}") from None

    import copy

    d = _map_ids(copy.deepcopy(d), hex_to_b64)
    req = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(d, req, ignore_unknown_fields=True)
    except (json_format.ParseError, TypeError, AttributeError, KeyError, OverflowError) as exc:
        raise ValueError(f"not an OTLP trace export request: {exc}") from None
    return req


def from_json(text: str | bytes) -> ExportTraceServiceRequest:
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed JSON: {exc}") from None
    return from_dict(d)
