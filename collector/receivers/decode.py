"""Decoding OTLP trace payloads (protobuf or JSON, optionally gzip) and walking their spans.

Only the spans the collector derives from are turned into :class:`SpanRecord` (request spans
with the attributes derivation reads; phase spans with names, ids and times); every span is
counted. Spans with
invalid ids or an end before their start are rejected and counted (``partial_success``).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

from google.protobuf.message import DecodeError as _PBDecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from otel_llm import semconv as sc
from otel_llm.otlp_json import from_json
from otel_llm.otlp_spans import SpanRecord, any_value, attributes_dict

from ..int_arrays import RawIntArray

ROOT_SPANS = frozenset(sc.REQUEST_SPANS)
PHASE_SPANS = frozenset((sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE, sc.SPAN_PREEMPTION, sc.SPAN_STREAM))
_ARRAY_KEYS = frozenset((sc.TOKEN_EVENT_OFFSETS, sc.TOKEN_EVENT_TOKENS))
#: the request-span attributes derivation reads (the rest travel on to --forward-traces untouched)
_ROOT_KEYS = frozenset((sc.REQUEST_ID, sc.REQUEST_MODEL, sc.STATUS, sc.INPUT_TOKENS, sc.TOKEN_EVENT_ESTIMATED,
                        sc.BOUNDARY))
_ZERO_TRACE = bytes(16)
_ZERO_SPAN = bytes(8)


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
    req = ExportTraceServiceRequest()
    try:
        req.ParseFromString(body)
    except (_PBDecodeError, RuntimeError, ValueError) as exc:
        raise DecodeError(f"malformed protobuf: {exc}") from None
    return req


@dataclass
class WalkResult:
    spans: list[SpanRecord]  # the ones the collector derives from
    total: int  # every span in the request
    rejected: int
    first_error: str | None = None


def walk(req: ExportTraceServiceRequest) -> WalkResult:
    out: list[SpanRecord] = []
    total = rejected = 0
    first_error = None
    for rs in req.resource_spans:
        res = None
        for ss in rs.scope_spans:
            for s in ss.spans:
                total += 1
                name = s.name
                is_root = name in ROOT_SPANS
                if not is_root and name not in PHASE_SPANS:
                    continue
                tid, sid = s.trace_id, s.span_id
                start, end = s.start_time_unix_nano, s.end_time_unix_nano
                if len(tid) != 16 or len(sid) != 8 or tid == _ZERO_TRACE or sid == _ZERO_SPAN:
                    rejected += 1
                    first_error = first_error or f"span {name!r} has an invalid trace or span id"
                    continue
                if end < start:
                    rejected += 1
                    first_error = first_error or f"span {name!r} ends before it starts"
                    continue
                if is_root:
                    if res is None:
                        res = attributes_dict(rs.resource.attributes)
                    attrs = {}
                    for kv in s.attributes:
                        k = kv.key
                        if k in _ARRAY_KEYS:
                            v = kv.value
                            attrs[k] = (RawIntArray(v.array_value.SerializeToString())  # decoded in bulk
                                        if v.HasField("array_value") else any_value(v))
                        elif k in _ROOT_KEYS:
                            attrs[k] = any_value(kv.value)
                elif name == sc.SPAN_PREEMPTION:
                    attrs = attributes_dict(s.attributes)
                else:
                    attrs = {}
                out.append(SpanRecord(tid.hex(), sid.hex(), s.parent_span_id.hex(), name, s.kind, start, end,
                                      attrs, s.status.code, res if is_root else {}))
    return WalkResult(out, total, rejected, first_error)


def decode_payload(body: bytes, *, json_body: bool = False, gzipped: bool = False,
                   max_bytes: int = 4 * 2 ** 20) -> tuple[ExportTraceServiceRequest, WalkResult]:
    if len(body) > max_bytes:
        raise PayloadTooLarge(f"body of {len(body)} bytes is over the {max_bytes}-byte limit")
    if gzipped:
        body = gunzip(body, max_bytes)
    req = parse_request(body, json_body)
    return req, walk(req)


__all__ = ["DecodeError", "PayloadTooLarge", "decode_payload", "parse_request", "walk", "WalkResult"]
