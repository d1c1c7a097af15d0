"""Engine step spans: taken out of each export request (no trace assembly), stored in table
``steps`` with their attributes, and read from a traces file the same way."""

from __future__ import annotations

import numpy as np
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from support.otlp_helpers import Req, sample_request

from collector.analysis.offline import read_trace_file
from collector.storage.store import RequestStore
from otel_llm import semconv as sc


def step_request(n: int, base_ns: int = 1_700_000_000 * 10**9, service: str = "vllm-a") -> bytes:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = service
    ss = rs.scope_spans.add()
    root = ss.spans.add(trace_id=b"\7" * 16, span_id=b"\1" * 8, name=sc.SPAN_STEPS)
    root.start_time_unix_nano, root.end_time_unix_nano = base_ns, base_ns + n * 10**7
    for i in range(n):
        s = ss.spans.add(trace_id=b"\7" * 16, span_id=(i + 2).to_bytes(8, "big"), parent_span_id=b"\1" * 8)
        s.name = sc.SPAN_STEP
        s.start_time_unix_nano = base_ns + i * 10**7
        s.end_time_unix_nano = base_ns + i * 10**7 + 8 * 10**6
        for key, v in (
            (sc.STEP_INDEX, i),
            (sc.STEP_BATCH_SIZE, 4 + i % 3),
            (sc.STEP_PREFILL_TOKENS, 100 if i == 0 else 0),
            (sc.STEP_DECODE_TOKENS, 4),
            (sc.STEP_PREEMPTED, 1 if i == 3 else 0),
        ):
            s.attributes.add(key=key).value.int_value = v
        if i % 2 == 0:
            s.attributes.add(key=sc.STEP_KV_USAGE).value.double_value = 0.25 + i / 100
    return req.SerializeToString()


def test_steps_are_stored_apart_from_requests(make_collector):
    c = make_collector()
    c.accept(step_request(6))
    c.accept(step_request(6))  # the same steps again (a retry): stored once
    c.accept(sample_request([Req("s1")]).SerializeToString())
    c.stop()
    assert c.steps_received == 12 and c.store_writer.steps_stored == 6
    assert c.assembler.counters.spans_received == 5  # the request's 5 spans only: steps are not assembled
    s = RequestStore(c.config.store)
    st = s.steps()
    assert len(st) == 6 and s.count() == 2
    assert st.step_index.tolist() == list(range(6)) and st.batch_size.tolist() == [4, 5, 6, 4, 5, 6]
    assert st.prefill_tokens.tolist() == [100, 0, 0, 0, 0, 0] and st.preempted.tolist() == [0, 0, 0, 1, 0, 0]
    assert np.allclose(st.kv_usage[::2], [0.25, 0.27, 0.29]) and np.isnan(st.kv_usage[1::2]).all()
    assert (st.gpu_time_ns == -1).all() and st.service == ["vllm-a"] * 6
    assert np.allclose(st.duration_s, 0.008)
    window = s.steps(since_ns=st.start_ns[2], until_ns=st.start_ns[3])
    assert window.step_index.tolist() == [2, 3]  # those overlapping the window
    s.close()


def test_steps_from_a_traces_file(tmp_path):
    from otel_llm.otlp.otlp_json import to_json

    path = tmp_path / "t.jsonl"
    req = ExportTraceServiceRequest.FromString(step_request(4))
    req.MergeFrom(sample_request([Req("f1")]))
    path.write_text(to_json(req) + "\n")
    batch, steps = read_trace_file(str(path))
    assert len(steps) == 4 and len(batch) == 2 and steps.decode_tokens.tolist() == [4] * 4


def test_steps_waiting_for_the_store_are_bounded(make_collector):
    """Engine steps wait for the store in a buffer bounded by --max-backlog (x10): past it they are
    dropped and counted, never an unbounded list."""
    c = make_collector(max_backlog=1)  # room for 10 steps
    c.pause()
    c.accept(step_request(6))
    c.accept(step_request(6, base_ns=1_800_000_000 * 10**9))
    assert c.steps_received == 12 and c.steps_dropped == 2
    assert c.self_counters()["engine_steps_dropped"] == 2


def test_the_steps_table_batch_and_parquet_come_from_one_declaration(tmp_path):
    """STEP_COLUMN_DECL makes the SQLite table, the batch's fields and the Parquet schema: a step
    with every unknown kind (-1 counts, NaN share, None text) goes through the store and back
    unchanged, and a batch given only the required columns has the rest unknown."""
    import pyarrow as pa

    from collector.analysis.parquet import steps_table
    from collector.pipeline.steps import STEP_COLUMN_DECL, STEP_COLUMNS, StepBatch

    store = RequestStore(str(tmp_path / "s.db"))
    table = [row[1] for row in store._db.execute("PRAGMA table_info(steps)")]
    assert table == ["rowid", *STEP_COLUMNS] and [f for f in StepBatch.__dataclass_fields__] == STEP_COLUMNS
    ns = np.array([10, 20], np.int64)
    given = StepBatch(trace_id=["a" * 32] * 2, span_id=["1" * 16, "2" * 16], start_ns=ns, end_ns=ns + 5)
    assert given.service == [None, None] and given.batch_size.tolist() == [-1, -1]
    assert np.isnan(given.kv_usage).all() and given.wait_reason == [None, None]
    full = StepBatch.from_rows(
        [(*given.rows()[0][:5], 7, 4, 0, 4, 0, 0.5, 1200, 3, "kv_cache", 12, 5), given.rows()[1]]
    )
    store.add(full)
    back = store.steps()
    assert back.rows() == full.rows()
    assert back.rows()[1][5:] == (None,) * 11  # every unknown as NULL, whatever its kind
    t = steps_table(back)
    assert t.column_names == STEP_COLUMNS and t.schema.field("kv_usage").type == pa.float64()
    assert {f.name: f.metadata[b"doc"].decode() for f in t.schema} == {c.name: c.doc for c in STEP_COLUMN_DECL}
    store.close()
