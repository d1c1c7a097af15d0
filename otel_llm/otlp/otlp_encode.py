"""Fast OTLP encoding of finished spans whose attributes hold long integer arrays.

The OpenTelemetry SDK's encoder builds one protobuf ``AnyValue`` per array element in Python,
so a request span with two 256-entry token-event arrays costs about 0.7 ms to encode, and its
OTLP/JSON form (``MessageToDict``) 1.4 ms more. Here an integer array becomes its ``ArrayValue``
wire bytes in one vectorised numpy pass (each element is ``0x0a, len, 0x18, varint``) that
protobuf's C parser merges in; everything else is encoded field by field as the SDK does.
``encode_spans`` gives the same message as the SDK's (the tests compare them). The JSON writer
writes the OTLP/JSON text directly, as json.dumps would write the protobuf JSON mapping's
dictionary (the tests parse it back and compare), without the dictionary.
"""

from __future__ import annotations

import json
import math
import struct
from array import array
from collections.abc import Sequence

import numpy as np
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind
from opentelemetry.trace.span import DEFAULT_TRACE_STATE
from opentelemetry.trace.status import StatusCode

from otel_llm import accelerator

from .sdk_internals import dropped_attributes, encode_attributes, sdk_encode_spans, span_fields

try:  # the C writer of integer arrays as JSON text (setup.py; optional)
    from . import _int_text
except ImportError:  # pragma: no cover - built where a C compiler is
    _int_text = None

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
    if 0 <= v < 16384:  # lengths of most fields, small counts
        return bytes(((v & 0x7F) | 0x80, v >> 7))
    v &= _MASK64
    b = bytearray()
    while v > 0x7F:
        b.append((v & 0x7F) | 0x80)
        v >>= 7
    b.append(v)
    return bytes(b)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    n = len(payload)
    return tag + (_BYTE[n] if n < 128 else _varint(n)) + payload


#: a length-delimited protobuf field's bytes, for other writers at the wire level (the records' logs)
length_delimited = _field


def export_request_bytes(groups: dict[bytes, dict[bytes, list[bytes]]]) -> bytes:
    """An OTLP ``Export{Trace,Logs}ServiceRequest`` (the two share their layout) at the wire level:
    ``{serialized Resource: {serialized InstrumentationScope: items}}``, each item already framed
    as field 2 of its scope's message (``ScopeSpans.spans``, ``ScopeLogs.log_records``)."""
    out = []
    for resource, scopes in groups.items():
        body = [_field(b"\x0a", resource)]  # Resource{Spans,Logs}.resource
        for scope, items in scopes.items():  # .scope_{spans,logs}: {scope, items}
            body.append(_field(b"\x12", _field(b"\x0a", scope) + b"".join(items)))
        out.append(_field(b"\x0a", b"".join(body)))  # the request's resource_{spans,logs}
    return b"".join(out)


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
    """One span attribute as its wire bytes, framed (``Span.attributes``, field 9: tag, length,
    ``KeyValue``); for an integer array, its index in ``arrays`` (encoded and framed later, all at
    once); None when the SDK must encode the span."""
    t = type(value)
    if t is str or t is bool or (t is int and -1 <= value < 4096):  # repeats: boundary, model, counts
        kv = _constants.get((key, value, t))
        if kv is None:
            kv = _constants.put((key, value, t), _field(b"\x4a", _key(key) + _field(b"\x12", _scalar(value))))
        return kv
    if t is int and -(2**63) <= value < 2**63:  # the most common after str: counts, sizes
        return _field(b"\x4a", _key(key) + _field(b"\x12", b"\x18" + _varint(value)))
    if t is np.ndarray:  # an int64 array from engine_hooks (its span factory's int_arrays)
        if value.dtype.kind == "i" and value.ndim == 1:
            arrays.append((_key(key), value))
            return len(arrays) - 1
        value = value.tolist()
        t = list
    if t is list or t is tuple:
        if value:
            ints = np.asarray(value)
            if ints.dtype.kind == "i" and ints.ndim == 1:  # int64 (bools, floats, huge ints: other dtypes)
                arrays.append((_key(key), ints))
                return len(arrays) - 1
        parts = []
        for x in value:
            b = _scalar(x)
            if b is None:
                return None
            parts.append(_field(b"\x0a", b))
        return _field(b"\x4a", _key(key) + _field(b"\x12", _field(b"\x2a", b"".join(parts))))
    for base, plain in _PLAIN:  # a subclass (an IntEnum, a str Enum) as the SDK takes it, in its order
        if isinstance(value, base):
            value = plain(value)
            break
    b = _scalar(value)
    return None if b is None else _field(b"\x4a", _key(key) + _field(b"\x12", b))


def _key(key: str) -> bytes:
    """``KeyValue.key`` (field 1) of ``key``, memoised."""
    kb = _keys.get(key)
    if kb is None:
        kb = _keys.put(key, _field(b"\x0a", key.encode("utf-8", "surrogatepass")))
    return kb


_KIND_FIELD = {id(k): b"\x30" + _BYTE[v] for k, v in _KIND.items()}  # Span.kind, by the enum member
_FLAGS_FIELD = (b"\x85\x01" + _FLAGS.pack(_HAS_IS_REMOTE), b"\x85\x01" + _FLAGS.pack(_HAS_IS_REMOTE | _IS_REMOTE))
_statuses = _Cache(64)  # id(status) -> (status, Span.status field): spans mostly share one status


def _status_field(st) -> bytes:
    """``Span.status`` (field 15) of ``st``, present even when unset, as the SDK writes it."""
    hit = _statuses.get(id(st))
    if hit is not None and hit[0] is st:  # the object is held in the cache: its id is its own
        return hit[1]
    body = b""
    if st.description:
        body += _field(b"\x12", st.description.encode("utf-8", "surrogatepass"))
    if st.status_code is not StatusCode.UNSET:
        body += b"\x18" + _BYTE[_STATUS[st.status_code]]
    return _statuses.put(id(st), (st, _field(b"\x7a", body)))[1]


def _span_parts(s: ReadableSpan, arrays: list) -> list | None:
    """``s`` as a list of wire pieces (bytes, and the indexes of its integer arrays in
    ``arrays``); None when the SDK must encode it (events, links, attribute types not covered)."""
    name, ctx, parent, kind, start, end, attrs, st, events, links, _, _ = span_fields(s)
    if events or links or start is None or end is None:
        return None
    mark = len(arrays)
    head = b"\x0a\x10" + ctx[0].to_bytes(16, "big") + b"\x12\x08" + ctx[1].to_bytes(8, "big")
    ts = ctx[4]  # SpanContext: (trace id, span id, remote, flags, trace state, valid)
    if ts is not DEFAULT_TRACE_STATE and ts:
        head += _field(b"\x1a", ts.to_header().encode())
    if parent is not None:
        head += b"\x22\x08" + parent[1].to_bytes(8, "big")
    name_b = _names.get(name)
    if name_b is None:
        name_b = _names.put(name, _field(b"\x2a", name.encode("utf-8", "surrogatepass")))
    kind_b = _KIND_FIELD.get(id(kind)) or b"\x30" + _BYTE[_KIND[kind]]
    parts: list = [head, name_b, kind_b, _FIXED64_PAIR.pack(0x39, start, 0x41, end)]
    if attrs:
        for key, value in attrs.items():
            kv = _attribute(key, value, arrays)
            if kv is None:
                del arrays[mark:]
                return None
            parts.append(kv)
    dropped = dropped_attributes(attrs)
    if dropped:
        parts.append(b"\x50" + _varint(dropped))
    if st is not None:
        parts.append(_status_field(st))
    parts.append(_FLAGS_FIELD[parent is not None and bool(parent[2])])
    return parts


class _ListArrays:
    """A span as the SDK's encoder reads it, its int64 numpy arrays as lists (the types the
    OpenTelemetry API allows): everything else is the span's own."""

    def __init__(self, span: ReadableSpan):
        self._span = span
        self.attributes = {k: v.tolist() if type(v) is np.ndarray else v for k, v in span.attributes.items()}

    def __getattr__(self, name: str):
        return getattr(self._span, name)


def _sdk_typed(s: ReadableSpan):
    """``s`` for the SDK's encoder: a span that falls back to it (an attribute type ours leaves
    out, e.g. a numpy scalar an engine's extractor returned) keeps its token-event arrays, which
    engine_hooks hands over as numpy arrays and the SDK would drop with the rest."""
    attrs = s.attributes or {}
    return _ListArrays(s) if any(type(v) is np.ndarray for v in attrs.values()) else s


def encode_spans_bytes(spans: Sequence[ReadableSpan]) -> bytes:
    """The serialized ``ExportTraceServiceRequest`` of ``spans``: the message the SDK's encoder
    builds, written as wire bytes directly (pieces that repeat are memoised, integer arrays
    encoded in one vectorised pass). Spans with events, links or attribute types not covered
    here are encoded by the SDK."""
    groups: dict = {}  # id(resource) -> (resource, {scope: [span pieces]}), in order of appearance
    arrays: list = []  # (key bytes, int64 array) of every integer array of the batch
    last_g, last_scope, members = None, None, []  # spans of one resource and scope mostly come together
    for s in spans:
        res, scope = s.resource, s.instrumentation_scope
        g = groups.get(id(res))
        if g is None:
            g = groups[id(res)] = (res, {})
        mark = len(arrays)
        parts = _span_parts(s, arrays)
        if parts is None:
            parts = [sdk_encode_spans([_sdk_typed(s)]).resource_spans[0].scope_spans[0].spans[0].SerializeToString()]
        if len(arrays) == mark:  # no integer array: the span's bytes now
            parts = _field(b"\x12", b"".join(parts))
        if g is not last_g or scope is not last_scope:
            members = g[1].setdefault(scope, [])
            last_g, last_scope = g, scope
        members.append(parts)
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
            else:
                ss.scope.SetInParent()  # the SDK writes an empty scope for a span without one
            pieces = [ss.SerializeToString()]
            for parts in span_parts:
                if type(parts) is bytes:
                    pieces.append(parts)
                else:
                    pieces.append(_field(b"\x12", b"".join([blobs[p] if type(p) is int else p for p in parts])))
            body.append(_field(b"\x12", b"".join(pieces)))
        out.append(_field(b"\x0a", b"".join(body)))
    return b"".join(out)


def encode_spans(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    """Same as the SDK's ``encode_spans`` (the tests compare them), fast: see
    :func:`encode_spans_bytes`."""
    return ExportTraceServiceRequest.FromString(encode_spans_bytes(spans))


# -- OTLP/JSON --------------------------------------------------------------------------------

#: a str as json.dumps writes it (quoted, escaped, ASCII only): the json module's C function
_quote = json.encoder.encode_basestring_ascii
_NONFINITE = {"nan": '"NaN"', "inf": '"Infinity"', "-inf": '"-Infinity"'}  # proto3 JSON spells these as strings


def _json_value(value) -> str:
    """One attribute value as OTLP/JSON ``AnyValue`` text (what json.dumps writes for the dict
    the protobuf JSON mapping gives): a subclass by the plain type it subclasses, in the SDK's order."""
    if isinstance(value, bool):
        return '{"boolValue":true}' if value else '{"boolValue":false}'
    if isinstance(value, int):
        return '{"intValue":"' + str(value) + '"}'
    if isinstance(value, float):
        if not math.isfinite(value):
            return '{"doubleValue":' + _NONFINITE[repr(float(value))] + "}"
        return '{"doubleValue":' + float.__repr__(value) + "}"
    if isinstance(value, str):
        return '{"stringValue":' + _quote(value) + "}"
    if isinstance(value, (list, tuple, np.ndarray)):
        out: list[str] = []
        _json_array(value, out)
        return "".join(out)
    return '{"stringValue":' + _quote(str(value)) + "}"


def _json_array(value, out: list[str]) -> None:
    """An array attribute value's text, appended to ``out`` in pieces (a long one is copied once,
    by the final join)."""
    ints = False
    c = accelerator.active(_int_text)
    if type(value) is np.ndarray:  # engine_hooks' int64 arrays need no look at each element
        ints = value.dtype.kind == "i" and value.ndim == 1
        if ints and c is not None and len(value):
            out += ('{"arrayValue":{"values":[', c.values_json(np.ascontiguousarray(value, dtype=np.int64)), "]}}")
            return
        value = value.tolist()
    if value and (ints or all(type(x) is int for x in value)):  # no call per element
        if c is not None and min(value) >= -(2**63) and max(value) < 2**63:
            out += ('{"arrayValue":{"values":[', c.values_json(array("q", value)), "]}}")
        else:
            out += ('{"arrayValue":{"values":[{"intValue":"', '"},{"intValue":"'.join(map(str, value)), '"}]}}')
        return
    out += ('{"arrayValue":{"values":[', ",".join(map(_json_value, value)), "]}}")


_json_keys, _json_constants = _Cache(), _Cache()


def _json_attrs(attrs, out: list[str]) -> None:
    """A span's (or an event's, a resource's) attributes as the text of an OTLP/JSON KeyValue
    list, appended to ``out``; a string or bool attribute that repeats (the boundary, the model)
    is written once and memoised."""
    out.append("[")
    sep = ""
    for k, v in (attrs or {}).items():
        t = type(v)
        if t is str or t is bool:
            kv = _json_constants.get((k, v, t))
            if kv is None:
                kv = _json_constants.put((k, v, t), '{"key":' + _quote(k) + ',"value":' + _json_value(v) + "}")
            out += (sep, kv)
        else:
            kp = _json_keys.get(k)
            if kp is None:
                kp = _json_keys.put(k, '{"key":' + _quote(k) + ',"value":')
            if t is np.ndarray or t is list or t is tuple:
                out += (sep, kp)
                _json_array(v, out)
                out.append("}")
            else:
                out += (sep, kp, _json_value(v), "}")
        sep = ","
    out.append("]")


def _json_span(s: ReadableSpan, out: list[str]) -> None:
    """One span's OTLP/JSON text, appended to ``out``."""
    name, ctx, parent, kind, start, end, attrs, st, events, _, _, _ = span_fields(s)
    flags = _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent[2] else 0)
    status = "{}"
    if st is not None and st.status_code is not StatusCode.UNSET:
        status = '{"code":' + str(_STATUS[st.status_code])
        status += (',"message":' + _quote(st.description) + "}") if st.description else "}"
    parent_id = f',"parentSpanId":"{parent[1]:016x}"' if parent is not None else ""
    out.append(
        f'{{"traceId":"{ctx[0]:032x}","spanId":"{ctx[1]:016x}"{parent_id},"name":{_quote(name)},'
        f'"kind":{_KIND[kind]},"startTimeUnixNano":"{start}","endTimeUnixNano":"{end}",'
        f'"status":{status},"flags":{flags},"attributes":'
    )
    _json_attrs(attrs, out)
    if events:
        out.append(',"events":[')
        for i, e in enumerate(events):
            out.append(f'{"," if i else ""}{{"timeUnixNano":"{e.timestamp}","name":{_quote(e.name)},"attributes":')
            _json_attrs(e.attributes, out)
            out.append("}")
        out.append("]")
    out.append("}")


def spans_to_json(spans: Sequence[ReadableSpan]) -> str:
    """One OTLP/JSON ``ExportTraceServiceRequest`` line for ``spans`` (hex ids, int64 as strings,
    enums as integers), written as text directly: no dictionary per span, no protobuf; the pieces
    are joined once."""
    groups: dict = {}  # id(resource) -> (resource, {scope: [spans]}), in order of appearance
    for s in spans:
        res = s.resource
        g = groups.get(id(res))
        if g is None:
            g = groups[id(res)] = (res, {})
        g[1].setdefault(s.instrumentation_scope, []).append(s)
    out = ['{"resourceSpans":[']
    for i, (res, scopes) in enumerate(groups.values()):
        out.append('{"resource":{"attributes":' if not i else ',{"resource":{"attributes":')
        _json_attrs(res.attributes, out)
        out.append('},"scopeSpans":[')
        for j, (scope, members) in enumerate(scopes.items()):
            head = "{}"
            if scope:
                head = '{"name":' + _quote(scope.name)
                head += (',"version":' + _quote(scope.version) + "}") if scope.version else "}"
            out.append(("," if j else "") + '{"scope":' + head + ',"spans":[')
            for k, s in enumerate(members):
                if k:
                    out.append(",")
                _json_span(s, out)
            out.append("]}")
        out.append("]}")
    out.append("]}")
    return "".join(out)
