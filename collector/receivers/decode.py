"""Decoding OTLP trace payloads (protobuf or JSON, optionally gzip) and walking their spans.

Only the spans the collector derives from are returned, as flat tuples (:mod:`collector.pipeline.walked_span`):
request spans and their phases, with the few attributes derivation reads; every span is counted.
Spans with invalid ids, an end before their start or past int64 ns (2262) are rejected and counted
(``partial_success``).

Protobuf payloads are walked by the C accelerator (:mod:`._otlp_walk`) straight from the wire
bytes; anything it does not handle exactly as protobuf would, JSON payloads, and installs without
the accelerator (or ``OTEL_LLM_PURE_PYTHON=1``) take protobuf's parser and :func:`walk_message`,
which gives the same tuples.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError as _PBDecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_llm import accelerator
from otel_llm.otlp.otlp_json import from_json

from ..pipeline import walked_span as sp

try:
    from . import _otlp_walk
except ImportError:  # built without a C compiler
    _otlp_walk = None


def wire_schema(root=ExportTraceServiceRequest.DESCRIPTOR) -> list[list[tuple[int, int, int]]]:
    """The message schema the C walk checks a body against, from the installed descriptors:
    ``schema[i]`` lists ``(field number, kind, message index)`` of message i (0: the root). Kinds:
    1 varint, 2 fixed64, 3 fixed32, 4 string (UTF-8 checked), 5 bytes, 6 message, 7 defer to
    protobuf (a repeated scalar, which may come packed; a group; a map)."""
    fd = root.fields[0].__class__
    kind_of = {
        **dict.fromkeys((fd.TYPE_INT32, fd.TYPE_INT64, fd.TYPE_UINT32, fd.TYPE_UINT64), 1),
        **dict.fromkeys((fd.TYPE_SINT32, fd.TYPE_SINT64, fd.TYPE_BOOL, fd.TYPE_ENUM), 1),
        **dict.fromkeys((fd.TYPE_FIXED64, fd.TYPE_SFIXED64, fd.TYPE_DOUBLE), 2),
        **dict.fromkeys((fd.TYPE_FIXED32, fd.TYPE_SFIXED32, fd.TYPE_FLOAT), 3),
        fd.TYPE_STRING: 4,
        fd.TYPE_BYTES: 5,
        fd.TYPE_MESSAGE: 6,
    }
    index: dict[str, int] = {}
    order = []

    def visit(d):
        if d.full_name not in index:
            index[d.full_name] = len(order)
            order.append(d)
            for f in d.fields:
                if f.message_type is not None:
                    visit(f.message_type)

    visit(root)
    schema = []
    for d in order:
        fields = []
        for f in d.fields:
            kind = kind_of.get(f.type, 7)
            repeated = f.is_repeated if hasattr(f, "is_repeated") else f.label == fd.LABEL_REPEATED
            if (repeated and kind in (1, 2, 3)) or (
                f.message_type is not None and f.message_type.GetOptions().map_entry
            ):
                kind = 7
            fields.append((f.number, kind, index[f.message_type.full_name] if kind == 6 else 0))
        schema.append(fields)
    return schema


if _otlp_walk is not None:
    _otlp_walk.set_schema(wire_schema())

_ZERO_TRACE = bytes(16)
_ZERO_SPAN = bytes(8)
_MAX_NS = 2**63 - 1  # times are int64 ns from here on


def accelerated() -> bool:
    """Whether protobuf payloads are walked by the C accelerator."""
    return accelerator.on(_otlp_walk)


class DecodeError(ValueError):
    """The payload is not a valid OTLP trace export request (-> INVALID_ARGUMENT / 400)."""


class PayloadTooLarge(DecodeError):
    """The payload (or its decompressed form) is over the configured size limit (-> 413)."""


def gunzip(body: bytes, max_bytes: int) -> bytes:
    """Decompress with a bound, so a small compressed bomb cannot take the memory."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise DecodeError(f"bad gzip body: {exc}") from None
    if len(out) > max_bytes or d.unconsumed_tail:
        raise PayloadTooLarge(f"decompressed body is over the {max_bytes}-byte limit")
    return out


def parse_request(body: bytes, json_body: bool = False) -> ExportTraceServiceRequest:
    if json_body:
        try:
            return from_json(body)
        except ValueError as exc:
            raise DecodeError(str(exc)) from None
        except RecursionError:  # [[[[... nested past the interpreter's depth
            raise DecodeError("malformed JSON: nested too deeply") from None
        except (SystemError, UnicodeError, TypeError) as exc:  # e.g. a lone surrogate in a key
            raise DecodeError(f"malformed JSON: {type(exc).__name__}: {exc}"[:300]) from None
    req = ExportTraceServiceRequest()
    try:
        req.ParseFromString(body)
    except (_PBDecodeError, RuntimeError, ValueError) as exc:
        raise DecodeError(f"malformed protobuf: {exc}") from None
    return req


@dataclass
class WalkResult:
    spans: list[tuple]  # the walked spans the collector derives from (collector.pipeline.walked_span layout)
    total: int  # every span in the request
    rejected: int
    first_error: str | None = None
    body: bytes | None = None  # the request as protobuf bytes (what --forward-traces sends on)


def _value(v):
    """An attribute value as the C walker returns it."""
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        vals = v.array_value.values
        if all(x.WhichOneof("value") == "int_value" for x in vals):
            return np.array([x.int_value for x in vals], dtype=np.int64).tobytes()
        return sp.INVALID
    if which in ("kvlist_value", "bytes_value", "string_value_strindex"):
        return sp.INVALID
    return getattr(v, which)


def walk_message(req: ExportTraceServiceRequest) -> WalkResult:
    """The spans of a parsed request, as the C walker returns them from its bytes."""
    out: list[tuple] = []
    total = rejected = 0
    first_error = None
    code_of, slots, width = sp.code_of, sp.ATTRIBUTE_SLOTS, len(sp.ATTRIBUTE_SLOTS)
    for rs in req.resource_spans:
        service = None
        for kv in rs.resource.attributes:
            if kv.key == sp.RESOURCE_KEY:
                service = _value(kv.value)
        for ss in rs.scope_spans:
            for s in ss.spans:
                total += 1
                code = code_of(s.name)
                if code is None:
                    continue
                tid, sid = s.trace_id, s.span_id
                start, end = s.start_time_unix_nano, s.end_time_unix_nano
                why = None
                if len(tid) != 16 or len(sid) != 8 or tid == _ZERO_TRACE or sid == _ZERO_SPAN:
                    why = "has an invalid trace or span id"
                elif end < start:
                    why = "ends before it starts"
                elif end > _MAX_NS:
                    why = "ends past the year 2262"
                if why:
                    rejected += 1
                    first_error = first_error or f"span {s.name!r} {why}"
                    continue
                attrs: list = [None] * width
                for kv in s.attributes:
                    i = slots.get(kv.key)
                    if i is not None:
                        attrs[i] = _value(kv.value)
                out.append((tid, sid, s.parent_span_id, code, s.kind, start, end, s.status.code, service, *attrs))
    return WalkResult(out, total, rejected, first_error)


def walk_bytes(body: bytes) -> WalkResult | None:
    """The C walk of a protobuf body; None where protobuf's own parser has to decide."""
    r = _otlp_walk.walk(body, sp.CODES, sp.ATTRIBUTE_SLOTS, sp.RESOURCE_KEY, sp.INVALID)
    return None if r is None else WalkResult(r[3], r[0], r[1], r[2], body)


def decode_payload(
    body: bytes, *, json_body: bool = False, gzipped: bool = False, max_bytes: int = 4 * 2**20
) -> WalkResult:
    if len(body) > max_bytes:
        raise PayloadTooLarge(f"body of {len(body)} bytes is over the {max_bytes}-byte limit")
    if gzipped:
        body = gunzip(body, max_bytes)
    if not json_body and accelerated():
        w = walk_bytes(body)
        if w is not None:
            return w
    req = parse_request(body, json_body)
    w = walk_message(req)
    w.body = req.SerializeToString() if json_body else body
    return w


__all__ = [
    "DecodeError",
    "PayloadTooLarge",
    "WalkResult",
    "accelerated",
    "decode_payload",
    "parse_request",
    "walk_bytes",
    "walk_message",
]
