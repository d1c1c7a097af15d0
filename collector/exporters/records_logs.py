"""Derived records as OpenTelemetry log records (``--forward-records URL``): any OTLP logs backend
(Loki, ClickHouse or Elasticsearch through the OpenTelemetry Collector) then holds one row per
request and boundary, as the store does.

Each record is one ``LogRecord``: ``event_name`` ``otel_llm.request``, ``time_unix_nano`` the
record's end (Unix ns), ``trace_id`` its trace (so a backend links it to the trace), ``body`` a
one-line summary, and an attribute ``otel_llm.<column>`` for every known column of
:data:`collector.pipeline.records.COLUMNS` (units as there: seconds, Unix ns, tokens), plus the token
events as int arrays ``otel_llm.event_offsets_ns`` and ``otel_llm.event_tokens``. The resource is
``service.name=otel-llm-collector`` with the collector's ``service.instance.id``.
"""

from __future__ import annotations

import math
import time

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord

from ..pipeline.records import COLUMNS, RecordBatch

EVENT_NAME = "otel_llm.request"
PREFIX = "otel_llm."
SEVERITY_INFO = 9


def _value(v) -> AnyValue | None:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    return AnyValue(string_value=str(v))


def records_to_logs(batch: RecordBatch, instance_id: str) -> bytes:
    """One ExportLogsServiceRequest (protobuf bytes) holding every record of ``batch``."""
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    for k, v in (("service.name", "otel-llm-collector"), ("service.instance.id", instance_id)):
        rl.resource.attributes.add(key=k).value.string_value = v
    sl = rl.scope_logs.add()
    sl.scope.name = "otel-llm.collector"
    now = time.time_ns()
    cols = batch.scalar_columns()
    names = [c.name for c in COLUMNS]
    st = batch.event_start.tolist()
    offs, toks = batch.event_offsets_ns.tolist(), batch.event_tokens.tolist()
    for i, values in enumerate(zip(*cols.values())):
        row = dict(zip(names, values))
        lr = LogRecord(
            time_unix_nano=int(row["end_ns"]),
            observed_time_unix_nano=now,
            severity_number=SEVERITY_INFO,
            severity_text="INFO",
            event_name=EVENT_NAME,
        )
        if row.get("trace_id"):
            try:
                lr.trace_id = bytes.fromhex(row["trace_id"])
            except ValueError:
                pass
        ttft = row.get("ttft")
        lr.body.string_value = (
            f"{row['boundary']} request {row['request_id']} {row['status']}"
            + (f", ttft {ttft * 1e3:.1f} ms" if isinstance(ttft, float) and ttft == ttft else "")
            + f", {row['output_tokens']} tokens"
        )
        attrs = []
        for name, v in row.items():
            av = _value(v)
            if av is not None:
                attrs.append(KeyValue(key=PREFIX + name, value=av))
        a, b = st[i], st[i + 1]
        for name, arr in (("event_offsets_ns", offs[a:b]), ("event_tokens", toks[a:b])):
            kv = KeyValue(key=PREFIX + name)
            kv.value.array_value.values.extend(AnyValue(int_value=x) for x in arr)
            attrs.append(kv)
        lr.attributes.extend(attrs)
        sl.log_records.append(lr)
    return req.SerializeToString()
