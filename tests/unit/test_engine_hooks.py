"""The generic hook API and the tracing pipeline, on the example engine and on small engines
defined here (no vLLM)."""

import logging
import os
import sys
import time

import pytest
from conftest import ROOT
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.spantree import check_nesting_and_order, request_trees

from engine_hooks import EngineHooks, TracingPipeline
from engine_hooks.hot_path.gpu_timer import CudaEventTimer
from otel_llm import semconv as sc
from otel_llm.otlp.export import FileSpanExporter
from otel_llm.otlp.span_records import read_trace_file

sys.path.insert(0, str(ROOT / "examples"))
import toy_engine


class Recorded:
    """Exporter that keeps spans as SpanRecords via a real OTLP JSON round trip."""

    def __init__(self, path):
        self.path = path
        self.exporter = FileSpanExporter(str(path))

    def spans(self):
        return read_trace_file(self.path)


@pytest.fixture
def toy(tmp_path):
    rec = Recorded(tmp_path / "spans.jsonl")
    pipeline = TracingPipeline(rec.exporter, service_name="toy", interval_s=0.05).start()
    toy_engine.hooks.use(pipeline)
    yield rec, pipeline
    pipeline.shutdown()


def run_toy(n=10, kv=500, traceparent=None):
    preempts = []
    eng = toy_engine.ToyEngine(kv_capacity=kv, max_batch=6, step_time_s=0)
    orig = eng.preempt
    eng.preempt = lambda r: (preempts.append(r.id), orig(r))
    for i in range(n):
        eng.add_request(
            toy_engine.Request(
                f"r{i}", prompt_len=30 + 7 * i, max_tokens=10 + 4 * i, traceparent=traceparent if i == 0 else None
            )
        )
    return eng.run(), preempts


def test_example_engine_spans(toy):
    rec, pipeline = toy
    tp_trace, tp_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    done, preempts = run_toy(traceparent=f"00-{tp_trace}-{tp_span}-01")
    assert preempts, "the KV budget should force preemptions"
    pipeline.shutdown()
    spans = rec.spans()
    trees = request_trees(spans)
    assert set(trees) == set(done)
    for rid, tree in trees.items():
        check_nesting_and_order(tree)
        root = tree["root"]
        assert root.kind == 2 and root.attributes[sc.STATUS] == "ok"
        assert root.attributes[sc.OUTPUT_TOKENS] == len(done[rid][1])
        assert len(tree["children"].get(sc.SPAN_PREEMPTION, [])) == preempts.count(rid)
        for p in tree["children"].get(sc.SPAN_PREEMPTION, []):
            assert p.attributes[sc.PREEMPTION_MODE] == "recompute"
    r0 = trees["r0"]["root"]
    assert r0.trace_id == tp_trace and r0.parent_span_id == tp_span  # joined the caller's trace
    assert len({t["root"].trace_id for t in trees.values()}) == len(trees)  # one trace per request
    steps = [s for s in spans if s.name == sc.SPAN_STEP]
    assert len(steps) > 10
    assert sum(s.attributes[sc.STEP_PREEMPTED] for s in steps) == len(preempts)
    assert all(sc.STEP_GPU_TIME_NS not in s.attributes for s in steps)  # CPU: absent
    assert [s.attributes[sc.STEP_INDEX] for s in steps] == sorted(s.attributes[sc.STEP_INDEX] for s in steps)
    assert pipeline.counters.hook_errors == 0 and pipeline.counters.spans_dropped == 0


def test_cancelled_request(toy):
    rec, pipeline = toy
    eng = toy_engine.ToyEngine(kv_capacity=10_000, step_time_s=0)
    eng.add_request(toy_engine.Request("keep", 10, 5))
    eng.add_request(toy_engine.Request("drop", 10, 50))
    eng.step()
    eng.step()
    eng.abort("drop")
    eng.run()
    pipeline.shutdown()
    trees = request_trees(rec.spans())
    drop = trees["drop"]["root"]
    assert drop.attributes[sc.STATUS] == "cancelled" and drop.status_code == 2
    assert drop.attributes[sc.ERROR_TYPE] == "cancelled"
    assert drop.attributes[sc.OUTPUT_TOKENS] == 2
    assert trees["keep"]["root"].attributes[sc.STATUS] == "ok"


def _make_engine(hooks: EngineHooks | None, broken: bool = False):
    """The same little engine, traced (with hooks) or plain (hooks=None); ``broken``: every
    extractor raises."""
    deco = (lambda d: d) if hooks else (lambda d: lambda f: f)
    h = hooks or EngineHooks(pipeline=TracingPipeline(None))
    x = (lambda *a, **k: 1 / 0) if broken else None

    class Engine:
        def __init__(self):
            self.out = []

        @deco(h.arrival(request_id=x or (lambda res, self, rid: rid)))
        def add(self, rid):
            self.out.append(("add", rid))

        @deco(h.token_out(outputs=x or (lambda _, self, rid, n: [(rid, n)])))
        def emit(self, rid, n):
            self.out.append(("tok", rid, n))
            return n * 2

        @deco(h.finish(request_id=x or (lambda res, self, rid: rid)))
        def finish(self, rid):
            self.out.append(("fin", rid))

    e = Engine()
    for i in range(5):
        e.add(f"q{i}")
        assert e.emit(f"q{i}", i + 1) == 2 * (i + 1)
        e.finish(f"q{i}")
    return e.out


def test_hook_that_raises_never_reaches_the_engine(tmp_path, caplog):
    plain = _make_engine(None)
    pipeline = TracingPipeline(FileSpanExporter(str(tmp_path / "s.jsonl")))
    hooks = EngineHooks(pipeline=pipeline)
    with caplog.at_level(logging.WARNING, logger="engine_hooks"):
        traced = _make_engine(hooks, broken=True)
    assert traced == plain
    assert pipeline.counters.hook_errors == 15
    assert sum("tracing hook failed" in r.message for r in caplog.records) == 1  # warned once


def test_unwritable_trace_file_is_counted(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    pipeline = TracingPipeline(FileSpanExporter(str(blocker / "spans.jsonl")))
    with caplog.at_level(logging.WARNING, logger="otel_llm"):
        out = _make_engine(EngineHooks(pipeline=pipeline))
        pipeline.shutdown()
    assert out == _make_engine(None)
    assert pipeline.counters.spans_dropped > 0 and pipeline.counters.spans_exported == 0
    assert sum("could not export spans" in r.message for r in caplog.records) == 1


def test_otlp_endpoint_down_is_counted(monkeypatch):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from support.otlp_helpers import free_port

    port = free_port()  # nothing listens there
    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout=1)
    pipeline = TracingPipeline(exporter)
    t0 = time.monotonic()
    out = _make_engine(EngineHooks(pipeline=pipeline))
    assert time.monotonic() - t0 < 1.0  # the engine never waits on the exporter
    assert out == _make_engine(None)
    pipeline.shutdown()
    assert pipeline.counters.spans_dropped == pipeline.counters.requests_traced * 3 > 0


def test_full_recorder_drops_and_counts():
    pipeline = TracingPipeline(None, capacity=4)
    out = _make_engine(EngineHooks(pipeline=pipeline))
    assert out == _make_engine(None)
    assert len(pipeline.recorder) == 4 and pipeline.recorder.dropped == 11


def test_in_flight_requests_are_bounded():
    mem = InMemorySpanExporter()
    pipeline = TracingPipeline(mem, max_in_flight=3)
    hooks = EngineHooks(pipeline=pipeline)

    @hooks.arrival(request_id=lambda res, rid: rid)
    def add(rid):
        pass

    for i in range(10):
        add(f"x{i}")
    pipeline.process()
    assert pipeline.tracker.evicted == 7 and len(pipeline.tracker.live) == 3
    evicted = [s for s in mem.get_finished_spans() if s.name == sc.SPAN_REQUEST]
    assert len(evicted) == 7 and all(s.attributes["llm.request.incomplete"] for s in evicted)


class FakeEvent:
    """A CUDA event stand-in: completes after it has been queried twice."""

    clock = 0.0

    def __init__(self, enable_timing=False):
        self.t = None
        self.queries = 0

    def record(self):
        FakeEvent.clock += 1.5  # ms of "GPU time" between consecutive records
        self.t = FakeEvent.clock
        self.queries = 0

    def query(self):
        self.queries += 1
        return self.queries >= 2

    def elapsed_time(self, end):
        return end.t - self.t


class FakeCuda:
    Event = FakeEvent
    initialized = True

    @classmethod
    def is_initialized(cls):
        return cls.initialized


def test_gpu_time_read_back_later_without_synchronising():
    mem = InMemorySpanExporter()
    timer = CudaEventTimer(FakeCuda())
    pipeline = TracingPipeline(mem, gpu_elapsed=timer.elapsed_ns)
    hooks = EngineHooks(pipeline=pipeline, gpu_timer=timer)

    class E:
        @hooks.schedule()
        def schedule(self):
            return "plan"

        @hooks.step(batch_size=lambda res, self, plan: 3)
        def run(self, plan):
            return plan

    e = E()
    FakeCuda.initialized = False  # no CUDA context yet (the model is not loaded): no GPU time, no error
    e.run(e.schedule())
    pipeline.process()
    (first,) = [s for s in mem.get_finished_spans() if s.name == sc.SPAN_STEP]
    assert sc.STEP_GPU_TIME_NS not in first.attributes
    mem.clear()
    FakeCuda.initialized = True
    for _ in range(4):
        e.run(e.schedule())
    pipeline.process()  # first query: not complete yet, nothing exported, nothing waited for
    assert [s for s in mem.get_finished_spans() if s.name == sc.SPAN_STEP] == []
    assert len(pipeline.tracker.pending_gpu) == 4
    pipeline.process()
    steps = [s for s in mem.get_finished_spans() if s.name == sc.SPAN_STEP]
    assert len(steps) == 4
    assert all(s.attributes[sc.STEP_GPU_TIME_NS] == 1_500_000 for s in steps)
    assert all(s.attributes[sc.STEP_BATCH_SIZE] == 3 for s in steps)
    assert len(timer._pool) == 8  # events recycled


def test_example_runs_as_a_user_would(tmp_path):
    import subprocess

    path = tmp_path / "toy.jsonl"
    env = {**os.environ, "OTEL_LLM_TRACES_FILE": str(path)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "toy_engine.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "12 requests done; 12 traced" in proc.stdout
    trees = request_trees(read_trace_file(path))
    assert len(trees) == 12
    for t in trees.values():
        check_nesting_and_order(t)
