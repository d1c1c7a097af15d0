"""What forwarding holds is what it counts (#47, item 7): the records' log requests are written at
the wire level in requests of bounded size, derivation takes its backlog in bounded passes, and
the trace policy holds spans as their wire bytes."""

from __future__ import annotations

from types import SimpleNamespace

from conftest import ROOT
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from collector.exporters.records_logs import records_to_logs
from collector.service import derivation_chunks
from collector.storage.store import open_existing


def _demo_batch():
    s = open_existing(str(ROOT / "tests" / "data" / "demo_store.db"))
    try:
        return s.batch(), s.records()
    finally:
        s.close()


def test_records_leave_as_log_requests_of_bounded_size_with_every_array_whole():
    batch, records = _demo_batch()
    bodies = records_to_logs(batch, "c1", max_bytes=20_000)
    assert len(bodies) > 1 and all(len(b) <= 20_000 for b in bodies)
    got = []
    for body in bodies:
        req = ExportLogsServiceRequest.FromString(body)
        (rl,) = req.resource_logs
        assert {kv.key: kv.value.string_value for kv in rl.resource.attributes} == {
            "service.name": "otel-llm-collector",
            "service.instance.id": "c1",
        }
        (sl,) = rl.scope_logs
        assert sl.scope.name == "otel-llm.collector"
        got.extend(sl.log_records)
    assert len(got) == len(records) == len(batch)
    for lr, r in zip(got, records):
        attrs = {kv.key: kv.value for kv in lr.attributes}
        assert attrs["otel_llm.request_id"].string_value == r.request_id and lr.time_unix_nano == r.end_ns
        assert [v.int_value for v in attrs["otel_llm.event_offsets_ns"].array_value.values] == list(r.event_offsets_ns)
        assert [v.int_value for v in attrs["otel_llm.event_tokens"].array_value.values] == list(r.event_tokens)
    assert len(records_to_logs(batch, "c1", max_bytes=1)) == len(batch)  # a record larger than the bound: alone


def test_derivation_takes_released_traces_in_bounded_passes_in_order():
    traces = [SimpleNamespace(i=i, bytes=b) for i, b in enumerate([5, 5, 5, 30, 1, 1, 1, 1])]
    chunks = list(derivation_chunks(traces, max_bytes=10, max_traces=3))
    assert [[t.i for t in c] for c in chunks] == [[0, 1], [2], [3], [4, 5, 6], [7]]
    assert list(derivation_chunks([])) == []
