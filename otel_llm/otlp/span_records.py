"""Spans as flat, plain-Python records: what a trace file (or any export request) holds, to read or
assert on (ids lowercase hex, times Unix ns, attribute values plain Python with arrays as lists).
Every attribute value goes through protobuf's Python API: simple, and the cost of a
straightforward reader (``benchmarks/collector_throughput.py`` measures it as one); the collector
walks the wire itself (``collector/receivers/decode.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from otel_llm.otlp.trace_file import read_trace_requests


@dataclass(slots=True)
class SpanRecord:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int  # OTLP SpanKind: 1 internal, 2 server, 3 client
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    status_code: int = 0  # 0 unset, 1 ok, 2 error
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def any_value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which)


def attributes_dict(kvs) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


def spans_from_request(req: ExportTraceServiceRequest) -> Iterator[SpanRecord]:
    for rs in req.resource_spans:
        res = attributes_dict(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                yield SpanRecord(
                    trace_id=s.trace_id.hex(),
                    span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(),
                    name=s.name,
                    kind=int(s.kind),
                    start_ns=int(s.start_time_unix_nano),
                    end_ns=int(s.end_time_unix_nano),
                    attributes=attributes_dict(s.attributes),
                    status_code=int(s.status.code),
                    resource=res,
                )


def read_trace_file(path: str | os.PathLike) -> list[SpanRecord]:
    """All spans of an OTLP JSON-lines file."""
    return [s for _, req in read_trace_requests(path) for s in spans_from_request(req)]
