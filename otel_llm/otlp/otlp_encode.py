"""Fast OTLP encoding of finished spans whose attributes hold long integer arrays.

The OpenTelemetry SDK's encoder builds one protobuf ``AnyValue`` per array element in Python,
so a request span with two 256-entry token-event arrays costs about 0.7 ms to encode, and its
OTLP/JSON form (``MessageToDict``) 1.4 ms more. Here an integer array becomes its ``ArrayValue``
wire bytes in one vectorised numpy pass (each element is ``0x0a, len, 0x18, varint``) that
protobuf's C parser merges in; everything else is encoded field by field as the SDK does.
``encode_spans`` gives the same message as the SDK's (the tests compare them). The JSON writer
builds the OTLP/JSON dictionary directly.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence

import numpy as np
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind
from opentelemetry.trace.status import StatusCode

from .sdk_internals import encode_attributes, sdk_encode_spans

_KIND = {SpanKind.INTERNAL: 1, SpanKind.SERVER: 2, SpanKind.CLIENT: 3, SpanKind.PRODUCER: 4, SpanKind.CONSUMER: 5}
_STATUS = {StatusCode.UNSET: 0, StatusCode.OK: 1, StatusCode.ERROR: 2}
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200


#: the least value with k + 1 seven-bit groups, k = 1..9 (a varint's length is 1 + how many it reaches)
_THRESHOLDS = np.array([1 << (7 * k) for k in range(1, 10)], dtype=np.uint64)
#: _ROWS[n]: the first n of an element's 13 possible bytes (0x0a, length, 0x18, a varint of 1..10)
_ROWS = np.arange(13, dtype=np.uint8)[None, :] < np.arange(14, dtype=np.uint8)[:, None]


def int_arrays_bytes(arrays: Sequence) -> list[bytes]:
    """The wire bytes of an ``ArrayValue`` of ``int_value`` elements for each array (int64, two's
    complement), all encoded in one vectorised pass: every element is written as a row of a
    fixed-width byte matrix (``0x0a``, its length, ``0x18``, its varint), and the rows' used bytes
    are taken in order."""
    if not arrays:
        return []
    lens = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    if not lens.sum():
        return [b""] * len(arrays)
    v = np.concatenate([np.asarray(x, dtype=np.int64) for x in arrays]).view(np.uint64)
    groups = np.searchsorted(_THRESHOLDS, v, side="right").astype(np.uint8) + np.uint8(1)  # varint bytes, 1..10
    g = int(groups.max())
    m = np.empty((len(v), 3 + g), dtype=np.uint8)
    m[:, 0] = 0x0A
    m[:, 1] = groups + np.uint8(1)
    m[:, 2] = 0x18
    rest = v
    for k in range(g):
        byte = (rest & np.uint64(0x7F)).astype(np.uint8)
        if k < g - 1:
            byte |= (groups > k + 1).view(np.uint8) << np.uint8(7)  # more groups follow
            rest = rest >> np.uint64(7)
        m[:, 3 + k] = byte
    size = groups + np.uint8(3)
    buf = m[np.take(_ROWS[:, : 3 + g], size, axis=0)].tobytes()
    byte_end = np.concatenate(([0], np.cumsum(size, dtype=np.int64)))[np.cumsum(lens)]
    byte_start = np.concatenate(([0], byte_end[:-1]))
    return [buf[a:b] for a, b in zip(byte_start.tolist(), byte_end.tolist())]


_MASK64 = (1 << 64) - 1
_BYTE = [bytes((i,)) for i in range(128)]
_FIXED64_PAIR = struct.Struct("<BQBQ")  # start (field 7) and end (field 8) times, fixed64
_FLAGS = struct.Struct("<I")
_DOUBLE = struct.Struct("<d")
_TRUE, _FALSE = b"\x10\x01", b"\x10\x00"  # AnyValue.bool_value


def _varint(v: int) -> bytes:
    """Protobuf varint of ``v`` (an int64 as two's complement, as protobuf writes it)."""
    if 0 <= v < 128:
        return _BYTE[v]
    v &= _MASK64
    b = bytearray()
    while v > 0x7F:
        b.append((v & 0x7F) | 0x80)
        v >>= 7
    b.append(v)
    return bytes(b)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return tag + _varint(len(payload)) + payload


class _Cache(dict):
    """Bounded memo of encoded pieces that repeat from span to span (attribute keys, names,
    constant key-values): emptied when it reaches ``limit`` entries."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def put(self, key, value: bytes) -> bytes:
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


_keys, _names, _constants = _Cache(), _Cache(), _Cache()


def _scalar(value) -> bytes | None:
    """The wire bytes of an ``AnyValue`` holding one scalar; None for a type left to the SDK
    (or an int beyond int64, which the SDK refuses)."""
    t = type(value)
    if t is str:
        return _field(b"\x0a", value.encode("utf-8", "surrogatepass"))
    if t is bool:
        return _TRUE if value else _FALSE
    if t is int:
        return b"\x18" + _varint(value) if -(2**63) <= value < 2**63 else None
    if t is float:
        return b"\x21" + _DOUBLE.pack(value)
    return None


#: the scalar types in the order the SDK tests them, with what makes a subclass's value plain
#: (``str(value)`` of a str Enum is its name, not its value)
_PLAIN = ((bool, bool), (str, str.__str__), (int, int), (float, float))


def _attribute(key: str, value, arrays: list) -> bytes | int | None:
    """One ``KeyValue`` as wire bytes; for an integer array, its index in ``arrays`` (encoded
    later, all at once); None when the SDK must encode the span."""
    kb = _keys.get(key)
    if kb is None:
        kb = _keys.put(key, _field(b"\x0a", key.encode("utf-8", "surrogatepass")))
    t = type(value)
    if t is int and -(2**63) <= value < 2**63:  # the most common after str: counts, sizes
        return kb + _field(b"\x12", b"\x18" + _varint(value))
    if t is str or t is bool:
        kv = _constants.get((key, value, t))
        if kv is None:
            kv = _constants.put((key, value, t), kb + _field(b"\x12", _scalar(value)))
        return kv
    if t is np.ndarray:  # an int64 array from engine_hooks (its span factory's int_arrays)
        if value.dtype.kind == "i" and value.ndim == 1:
            arrays.append((kb, value))
            return len(arrays) - 1
        value = value.tolist()
        t = list
    if t is list or t is tuple:
        if value:
            ints = np.asarray(value)
            if ints.dtype.kind == "i" and ints.ndim == 1:  # int64 (bools, floats, huge ints: other dtypes)
                arrays.append((kb, ints))
                return len(arrays) - 1
        parts = []
        for x in value:
            b = _scalar(x)
            if b is None:
                return None
            parts.append(_field(b"\x0a", b))
        return kb + _field(b"\x12", _field(b"\x2a", b"".join(parts)))
    for base, plain in _PLAIN:  # a subclass (an IntEnum, a str Enum) as the SDK takes it, in its order
        if isinstance(value, base):
            value = plain(value)
            break
    b = _scalar(value)
    return None if b is None else kb + _field(b"\x12", b)


def _span_parts(s: ReadableSpan, arrays: list) -> list | None:
    """``s`` as a list of wire pieces (bytes, and the indexes of its integer arrays in
    ``arrays``); None when the SDK must encode it (events, links, attribute types not covered)."""
    if s.events or s.links or s.start_time is None or s.end_time is None:
        return None
    mark = len(arrays)
    ctx = s.get_span_context()
    parent = s.parent
    head = b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big") + b"\x12\x08" + ctx.span_id.to_bytes(8, "big")
    if ctx.trace_state:
        head += _field(b"\x1a", ctx.trace_state.to_header().encode())
    if parent is not None:
        head += b"\x22\x08" + parent.span_id.to_bytes(8, "big")
    name = _names.get(s.name)
    if name is None:
        name = _names.put(s.name, _field(b"\x2a", s.name.encode("utf-8", "surrogatepass")))
    parts: list = [head, name, b"\x30" + _BYTE[_KIND[s.kind]], _FIXED64_PAIR.pack(0x39, s.start_time, 0x41, s.end_time)]
    for key, value in (s.attributes or {}).items():
        kv = _attribute(key, value, arrays)
        if kv is None:
            del arrays[mark:]
            return None
        parts.append(kv if type(kv) is int else _field(b"\x4a", kv))
    if s.dropped_attributes:
        parts.append(b"\x50" + _varint(s.dropped_attributes))
    st = s.status
    if st is not None:  # present even when unset, as the SDK writes it
        body = b""
        if st.description:
            body += _field(b"\x12", st.description.encode("utf-8", "surrogatepass"))
        if st.status_code is not StatusCode.UNSET:
            body += b"\x18" + _BYTE[_STATUS[st.status_code]]
        parts.append(_field(b"\x7a", body))
    flags = _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)
    parts.append(b"\x85\x01" + _FLAGS.pack(flags))
    return parts


def encode_spans_bytes(spans: Sequence[ReadableSpan]) -> bytes:
    """The serialized ``ExportTraceServiceRequest`` of ``spans``: the message the SDK's encoder
    builds, written as wire bytes directly (pieces that repeat are memoised, integer arrays
    encoded in one vectorised pass). Spans with events, links or attribute types not covered
    here are encoded by the SDK."""
    groups: dict = {}  # id(resource) -> (resource, {scope: [span pieces]}), in order of appearance
    arrays: list = []  # (key bytes, int64 array) of every integer array of the batch
    for s in spans:
        res, scope = s.resource, s.instrumentation_scope
        g = groups.get(id(res))
        if g is None:
            g = groups[id(res)] = (res, {})
        parts = _span_parts(s, arrays)
        if parts is None:
            parts = [sdk_encode_spans([s]).resource_spans[0].scope_spans[0].spans[0].SerializeToString()]
        g[1].setdefault(scope, []).append(parts)
    blobs = [
        _field(b"\x4a", kb + _field(b"\x12", _field(b"\x2a", blob)))
        for (kb, _), blob in zip(arrays, int_arrays_bytes([a for _, a in arrays]))
    ]
    out = []
    for res, scopes in groups.values():
        rs = ResourceSpans()
        rs.resource.attributes.extend(encode_attributes(res.attributes))
        if res.schema_url:
            rs.schema_url = res.schema_url
        body = [rs.SerializeToString()]
        for scope, span_parts in scopes.items():
            ss = ScopeSpans()
            if scope is not None:
                ss.scope.name = scope.name
                if scope.version:
                    ss.scope.version = scope.version
                if scope.schema_url:
                    ss.schema_url = scope.schema_url
                if scope.attributes:
                    ss.scope.attributes.extend(encode_attributes(scope.attributes))
            pieces = [ss.SerializeToString()]
            for parts in span_parts:
                span = b"".join([blobs[p] if type(p) is int else p for p in parts])
                pieces.append(_field(b"\x12", span))
            body.append(_field(b"\x12", b"".join(pieces)))
        out.append(_field(b"\x0a", b"".join(body)))
    return b"".join(out)


def encode_spans(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    """Same as the SDK's ``encode_spans`` (the tests compare them), fast: see
    :func:`encode_spans_bytes`."""
    return ExportTraceServiceRequest.FromString(encode_spans_bytes(spans))


# -- OTLP/JSON --------------------------------------------------------------------------------

_RAW_TAG = "\x00otel-llm-raw-"  # placeholder prefix; json.dumps writes it as \u0000otel-llm-raw-


def _json_value(value, raw: list | None = None):
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        if not math.isfinite(value):  # proto3 JSON spells these as strings
            return {"doubleValue": "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")}
        return {"doubleValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    ints = False
    if type(value) is np.ndarray:  # engine_hooks' int64 arrays need no look at each element
        ints = value.dtype.kind == "i" and value.ndim == 1
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if raw is not None and value and (ints or all(type(x) is int for x in value)):
            # integer arrays are spliced in as text after json.dumps: no dict per element
            raw.append('{"arrayValue":{"values":[{"intValue":"' + '"},{"intValue":"'.join(map(str, value)) + '"}]}}')
            return f"{_RAW_TAG}{id(raw)}-{len(raw) - 1}"
        return {"arrayValue": {"values": [_json_value(x, raw) for x in value]}}
    return {"stringValue": str(value)}


def _json_attrs(attrs, raw: list | None = None) -> list[dict]:
    return [{"key": k, "value": _json_value(v, raw)} for k, v in (attrs or {}).items()]


def spans_to_json(spans: Sequence[ReadableSpan]) -> str:
    """One OTLP/JSON ``ExportTraceServiceRequest`` line for ``spans`` (hex ids, int64 as strings,
    enums as integers), built without going through protobuf."""
    out: dict = {}
    raw: list[str] = []
    for s in spans:
        ctx = s.get_span_context()
        parent = s.parent
        d = {
            "traceId": format(ctx.trace_id, "032x"),
            "spanId": format(ctx.span_id, "016x"),
            "name": s.name,
            "kind": _KIND[s.kind],
            "startTimeUnixNano": str(s.start_time),
            "endTimeUnixNano": str(s.end_time),
            "attributes": _json_attrs(s.attributes, raw),
            "status": {},
            "flags": _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0),
        }
        if parent is not None:
            d["parentSpanId"] = format(parent.span_id, "016x")
        st = s.status
        if st is not None and st.status_code is not StatusCode.UNSET:
            d["status"] = {"code": _STATUS[st.status_code], **({"message": st.description} if st.description else {})}
        if s.events:
            d["events"] = [
                {"timeUnixNano": str(e.timestamp), "name": e.name, "attributes": _json_attrs(e.attributes)}
                for e in s.events
            ]
        key = (id(s.resource), s.instrumentation_scope)
        if key not in out:
            scope = s.instrumentation_scope
            out[key] = (
                s.resource,
                {
                    "scope": {"name": scope.name, **({"version": scope.version} if scope.version else {})}
                    if scope
                    else {},
                    "spans": [],
                },
            )
        out[key][1]["spans"].append(d)
    by_res: dict = {}
    for (rid, _), (res, ss) in out.items():
        by_res.setdefault(rid, {"resource": {"attributes": _json_attrs(res.attributes)}, "scopeSpans": []})
        by_res[rid]["scopeSpans"].append(ss)
    text = json.dumps({"resourceSpans": list(by_res.values())}, separators=(",", ":"))
    if not raw:
        return text
    pattern = re.compile(r'"\\u0000otel-llm-raw-' + str(id(raw)) + r'-(\d+)"')
    return pattern.sub(lambda m: raw[int(m.group(1))], text)
