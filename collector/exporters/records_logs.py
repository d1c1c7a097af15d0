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

import itertools
import math
import time

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from otel_llm.otlp.otlp_encode import export_request_bytes, int_arrays_bytes, length_delimited

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


#: the largest export request written (bytes): gRPC's default receive limit, 4 MiB; a record larger
#: than this alone goes in a request of its own
MAX_REQUEST_BYTES = 4 << 20
_CHUNK = 256  # records whose token-event arrays are encoded in one vectorised pass


def records_to_logs(batch: RecordBatch, instance_id: str, max_bytes: int = MAX_REQUEST_BYTES) -> list[bytes]:
    """The records of ``batch`` as ExportLogsServiceRequests (protobuf bytes), in order, each at
    most ``max_bytes``. The token-event arrays are written at the wire level
    (:func:`otel_llm.otlp.otlp_encode.int_arrays_bytes`), never as one protobuf object per element:
    a batch's worth of those took hundreds of MiB and seconds (#47)."""
    resource = Resource()
    for k, v in (("service.name", "otel-llm-collector"), ("service.instance.id", instance_id)):
        resource.attributes.add(key=k).value.string_value = v
    head = resource.SerializeToString()
    scope = InstrumentationScope(name="otel-llm.collector").SerializeToString()
    out: list[bytes] = []
    pieces: list[bytes] = []
    size = 0
    for record in _log_records(batch):
        piece = length_delimited(b"\x12", record)  # ScopeLogs.log_records
        if pieces and size + len(piece) > max_bytes:
            out.append(export_request_bytes({head: {scope: pieces}}))
            pieces, size = [], 0
        pieces.append(piece)
        size += len(piece)
    if pieces:
        out.append(export_request_bytes({head: {scope: pieces}}))
    return out


_ARRAY_KEYS = tuple(length_delimited(b"\x0a", (PREFIX + n).encode()) for n in ("event_offsets_ns", "event_tokens"))


def _log_records(batch: RecordBatch):
    """Each record as a serialized ``LogRecord``: its scalars through protobuf, then its two
    token-event arrays appended as ``attributes`` entries (field 6) at the wire level."""
    now = time.time_ns()
    cols = batch.scalar_columns()
    names = [c.name for c in COLUMNS]
    rows = zip(*cols.values())
    st, offs, toks = batch.event_start, batch.event_offsets_ns, batch.event_tokens
    n = len(batch)
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        bounds = st[a : b + 1].tolist()
        spans = list(itertools.pairwise(bounds))
        blobs = int_arrays_bytes([offs[i:j] for i, j in spans] + [toks[i:j] for i, j in spans])
        for k in range(b - a):
            lr = _log_record(dict(zip(names, next(rows))), now)
            arrays = b"".join(
                length_delimited(b"\x32", key + length_delimited(b"\x12", length_delimited(b"\x2a", blob)))
                for key, blob in zip(_ARRAY_KEYS, (blobs[k], blobs[b - a + k]))
            )
            yield lr.SerializeToString() + arrays


def _log_record(row: dict, now: int) -> LogRecord:
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
        + (f", {row['output_tokens']} tokens" if row["output_tokens"] is not None else ", tokens unknown")
    )
    lr.attributes.extend(
        KeyValue(key=PREFIX + name, value=av) for name, v in row.items() if (av := _value(v)) is not None
    )
    return lr
