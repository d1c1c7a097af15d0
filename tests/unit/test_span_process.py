"""Span building and export in a span process of its own (engine_hooks.span_process.parent): the same
spans as on the pipeline's thread, nothing delivered is lost when the engine's process is killed
or its process group stopped, and a span process that is stuck or dead never holds the engine up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import ROOT
from support.hook_feed import feed

from engine_hooks import EngineHooks, TracingPipeline, default_pipeline
from otel_llm import semconv as sc
from otel_llm.otlp.export import FileSpanExporter
from otel_llm.otlp.span_records import read_trace_file

sys.path.insert(0, str(ROOT / "benchmarks"))  # frontend_cost: vLLM's front end as its hooks see it


def _comparable(spans):
    """The spans without what differs between two runs: ids and the process's own resource."""
    return sorted(
        (s.name, s.kind, s.end_ns - s.start_ns, tuple(sorted((k, str(v)) for k, v in s.attributes.items())))
        for s in spans
    )


@pytest.mark.parametrize("detail", ["phases", "steps"])
def test_the_span_process_exports_what_the_pipeline_thread_would(tmp_path, monkeypatch, detail):
    here, there = tmp_path / "here.jsonl", tmp_path / "there.jsonl"
    monkeypatch.setenv("OTEL_LLM_TRACES_FILE", str(there))
    inproc = TracingPipeline(FileSpanExporter(str(here)), engine="toy", detail=detail)
    child = TracingPipeline(None, engine="toy", detail=detail, span_process=True)
    try:
        hooks = EngineHooks(inproc, strict=True)
        feed(hooks, 20)
        hooks.pipeline.recorder.record((0, 0, "never-finished", None, None, None, None))  # in flight at the flush
        for e in list(inproc.recorder._buf):  # the same events, so the same times, to both
            child.recorder.record(e)
        for p in (inproc, child):
            p.flush()
        assert child.sink is not None and child.sink.starts == 1
        a, b = read_trace_file(here), read_trace_file(there)
        assert len([s for s in b if s.name == sc.SPAN_REQUEST]) == 20
        assert _comparable(b) == _comparable(a)
        # the caller's trace is joined in the span process too
        assert {s.trace_id for s in b if s.name == sc.SPAN_REQUEST and s.attributes[sc.REQUEST_ID] == "r0"} == {
            "0af7651916cd43dd8448eb211c80319c"
        }
        assert child.counters.spans_exported == len(b) and child.counters.spans_dropped == 0
        assert child.counters.span_process_cpu_ns > 0
    finally:
        inproc.shutdown()
        child.shutdown()
    assert child.sink._proc is None  # ended with the pipeline


def test_the_http_server_span_crosses_to_the_span_process_whole(tmp_path, monkeypatch):
    """An HTTP record goes to the span process as a plain tuple (its chunk times as bytes): the
    server span built there is the one the pipeline's thread builds, every chunk's time in it."""
    from array import array

    from engine_hooks.asgi import _expand
    from engine_hooks.hot_path.hook_events import RAW
    from engine_hooks.spans.tracker import HttpRecord

    chunks = array("q", [3_000 + 7 * i for i in range(300)])
    rec = HttpRecord(1_000, 9_000_000, "POST", "/v1/completions", 200, 2_000, chunks)
    rec.trace_id, rec.span_id, rec.parent_span_id, rec.probability = b"\x01" * 16, b"\x02" * 8, b"\x03" * 8, 0.25
    back = HttpRecord.from_wire(rec.to_wire())
    assert back == rec and type(back.chunk_mono) is array
    here, there = tmp_path / "here.jsonl", tmp_path / "there.jsonl"
    monkeypatch.setenv("OTEL_LLM_TRACES_FILE", str(there))
    inproc = TracingPipeline(FileSpanExporter(str(here)), engine="toy")
    child = TracingPipeline(None, engine="toy", span_process=True)
    try:
        for p in (inproc, child):
            p.recorder.record((RAW, rec.end_mono, _expand, rec.to_wire()))  # as the middleware records it
            p.flush()
        assert child.sink is not None and child.sink.starts == 1
        a, b = read_trace_file(here), read_trace_file(there)
        assert len(a) == len(b) == 1 and _comparable(b) == _comparable(a)
        assert list(b[0].attributes[sc.HTTP_CHUNK_OFFSETS]) == [2_000 + 7 * i for i in range(300)]
    finally:
        inproc.shutdown()
        child.shutdown()


def test_the_default_pipeline_uses_a_span_process_unless_told_not_to(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_LLM_TRACES_FILE", str(tmp_path / "t.jsonl"))
    assert default_pipeline(engine="sp-default").sink is not None
    monkeypatch.setenv("OTEL_LLM_SPAN_PROCESS", "0")
    p = default_pipeline(engine="sp-off")
    assert p.sink is None and p.exporter is not None
    monkeypatch.delenv("OTEL_LLM_TRACES_FILE")
    monkeypatch.delenv("OTEL_LLM_SPAN_PROCESS")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    p = default_pipeline(engine="sp-none")
    assert p.sink is None and p.exporter is None  # nothing to export: no process started for it


def _script(body: str) -> str:
    return textwrap.dedent(
        f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / "tests")!r})
        from engine_hooks import EngineHooks
        from support.hook_feed import feed
        hooks = EngineHooks(engine="toy")
        """
    ) + textwrap.dedent(body)


def _run_script(body: str, traces) -> subprocess.CompletedProcess:
    """Run ``body`` (after :func:`_script`'s preamble) in a process of its own tracing to ``traces``."""
    env = {**os.environ, "OTEL_LLM_TRACES_FILE": str(traces)}
    return subprocess.run([sys.executable, "-c", _script(body)], env=env, capture_output=True, text=True, timeout=120)


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _requests(path) -> list[str]:
    return sorted(s.attributes[sc.REQUEST_ID] for s in read_trace_file(path) if s.name == sc.SPAN_REQUEST)


def test_sigkill_of_the_engine_process_loses_nothing_it_delivered(tmp_path):
    """The engine's process delivers (no flush, no waiting) and is killed at once: its span process
    reads to the end of the pipe, exports everything and exits."""
    traces = tmp_path / "t.jsonl"
    body = """
        feed(hooks, 200)
        hooks.pipeline.process()  # delivered: written to the span process, nothing waited for
        print(hooks.pipeline.sink._proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    proc = _run_script(body, traces)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    child = int(proc.stdout.split()[0])
    assert _gone(child, 30), "the span process outlived its parent's pipe"
    assert _requests(traces) == sorted(f"r{i}" for i in range(200))


def test_sigterm_to_every_process_loses_nothing(tmp_path):
    """A service manager stops the engine's process group and its span process (a cgroup, a
    container) at once: the engine process flushes on its way out, after the signal; the span
    process, signalled too, waits for that and exports it."""
    traces = tmp_path / "t.jsonl"
    body = """
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # vLLM's own handler ends the same way
        feed(hooks, 50)
        hooks.pipeline.flush()  # the span process is up and has taken them
        print(hooks.pipeline.sink._proc.pid, flush=True)
        while True:
            time.sleep(0.05)
            feed(hooks, 1, start=int(time.monotonic_ns() % 10**9) + 1000)
        """
    proc = subprocess.Popen(
        [sys.executable, "-c", _script(body)],
        env={**os.environ, "OTEL_LLM_TRACES_FILE": str(traces)},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        child = int(proc.stdout.readline())
        time.sleep(0.3)
        os.kill(child, signal.SIGTERM)  # in a group of its own: the group's signal does not reach it
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert _gone(child, 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    got = _requests(traces)
    assert {f"r{i}" for i in range(50)} <= set(got) and len(got) > 50  # and those after the signal's flush


def test_a_stuck_span_process_never_holds_the_engine(tmp_path, monkeypatch):
    """Stopped (SIGSTOP), it takes nothing: a delivery gives up at OTEL_BSP_EXPORT_TIMEOUT and
    counts the hook events it could not send; the hooks go on recording meanwhile. A frame cut short
    retires that span process (it exports what it got whole once it runs again) and the next
    delivery starts another: nothing after is lost."""
    monkeypatch.setenv("OTEL_LLM_TRACES_FILE", str(tmp_path / "t.jsonl"))
    monkeypatch.setenv("OTEL_BSP_EXPORT_TIMEOUT", "500")
    p = TracingPipeline(None, engine="toy", span_process=True)
    hooks = EngineHooks(p)
    feed(hooks, 5)
    p.flush()
    first = p.sink._proc
    os.kill(first.pid, signal.SIGSTOP)
    try:
        # one round of more than the pipe holds (1 MiB; about 120 bytes an event): its frame is cut
        # short whatever the timing (frames that filled the pipe exactly would leave the next one
        # unsent, not cut: the stream would go on, and the child stay)
        feed(hooks, 20_000, start=1000)
        t0 = time.monotonic()
        p.process()
        assert time.monotonic() - t0 < 0.5 + 5  # the delivery bounded by the timeout
        assert p.counters.events_dropped > 0
        assert first in p.sink._retired and p.sink._proc is None  # retired: the next delivery starts another
        t1 = time.perf_counter()
        feed(hooks, 1, start=99_999)  # the engine's side is a deque append, whatever the child does
        assert time.perf_counter() - t1 < 0.5
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=30) == 0  # retired: it ended by itself once it could run
    time.sleep(1.1)  # a span process is started again at most once a second
    feed(hooks, 10, start=500_000)
    p.flush()  # bounded by the 0.5 s timeout: on a busy host the new span process exports later
    assert p.sink.starts >= 2 and p.sink._proc.pid != first.pid
    deadline = time.monotonic() + 30
    while not {f"r{i}" for i in range(500_000, 500_010)} <= set(_requests(tmp_path / "t.jsonl")):
        assert time.monotonic() < deadline, "what was sent after the retired span process never came"
        time.sleep(0.2)
        p.flush()
    got = set(_requests(tmp_path / "t.jsonl"))
    assert {f"r{i}" for i in range(500_000, 500_010)} <= got and {f"r{i}" for i in range(5)} <= got
    p.shutdown()


def test_a_forked_child_gets_a_span_process_of_its_own(tmp_path):
    traces = tmp_path / "t.jsonl"
    body = """
        feed(hooks, 3)
        hooks.pipeline.flush()
        parent_child = hooks.pipeline.sink._proc.pid
        pid = os.fork()
        if pid == 0:
            feed(hooks, 4, start=100)
            hooks.pipeline.flush()
            ok = hooks.pipeline.sink._proc is not None and hooks.pipeline.sink._proc.pid != parent_child
            hooks.pipeline.shutdown()
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        feed(hooks, 2, start=200)
        hooks.pipeline.flush()
        assert hooks.pipeline.sink._proc.pid == parent_child  # the parent's is untouched
        print(os.waitstatus_to_exitcode(status), flush=True)
        """
    proc = _run_script(body, traces)
    assert proc.returncode == 0 and proc.stdout.split() == ["0"], proc.stderr[-2000:]
    expected = [f"r{i}" for i in (0, 1, 2, 100, 101, 102, 103, 200, 201)]
    assert _requests(traces) == sorted(expected)


def test_a_span_process_that_cannot_run_leaves_the_spans_to_the_pipeline_thread(tmp_path, monkeypatch):
    """A span process that exits as it starts (three times running): the pipeline says so once and
    builds and exports on its own thread; what it had not sent yet is not lost."""
    from engine_hooks.span_process import parent as span_process

    monkeypatch.setenv("OTEL_LLM_TRACES_FILE", str(tmp_path / "t.jsonl"))
    monkeypatch.setattr(span_process, "_CHILD", "import sys; sys.exit(3)")
    monkeypatch.setattr(span_process.SpanProcessSink, "restart_interval_s", 0.0)
    p = TracingPipeline(None, engine="toy", span_process=True)
    hooks = EngineHooks(p)
    for k in range(5):
        feed(hooks, 2, start=10 * k)
        p.process()
        if p.sink is not None and p.sink._proc is not None:
            p.sink._proc.wait()
    assert p.sink is None and p.exporter is not None  # on its own thread now
    assert p.counters.events_dropped > 0  # what went to the span processes that died is counted
    feed(hooks, 3, start=100)
    p.flush()
    assert {"r100", "r101", "r102"} <= set(_requests(tmp_path / "t.jsonl"))
    p.shutdown()


def test_an_expander_that_fails_costs_its_own_event_only(tmp_path, monkeypatch):
    from engine_hooks.hot_path.hook_events import RAW

    monkeypatch.setenv("OTEL_LLM_TRACES_FILE", str(tmp_path / "t.jsonl"))
    p = TracingPipeline(None, engine="toy", span_process=True)
    hooks = EngineHooks(p)
    feed(hooks, 2)
    p.recorder.record((RAW, 0, lambda tracker, mono, payload: payload.missing, object()))
    feed(hooks, 2, start=10)
    p.flush()
    assert _requests(tmp_path / "t.jsonl") == ["r0", "r1", "r10", "r11"]
    assert p._calls.failed_expansions == 1
    p.shutdown()


def _vllm_steps(hooks: EngineHooks, n: int) -> None:
    """``n`` requests through vLLM's front-end hooks on a stand-in OutputProcessor, fed vLLM's own
    ``EngineCoreOutput`` objects: the engine core's QUEUED, SCHEDULED and PREEMPTED events, its
    prefill account, several tokens in one output, and each way to finish."""
    from frontend_cost import StandInOutputProcessor, StandInRequest
    from vllm.v1.engine import EngineCoreEvent, EngineCoreOutput, FinishReason
    from vllm.v1.engine import EngineCoreEventType as T
    from vllm.v1.metrics.stats import PrefillStats

    from engine_hooks.vllm.frontend import instrument_output_processor

    op = StandInOutputProcessor()
    instrument_output_processor(op, hooks, "tiny")
    ids = [f"cmpl-{i}-x1" for i in range(n)]
    for i in range(n):
        op.add_request(StandInRequest(f"cmpl-{i}", prompt_tokens=8))
    t = time.monotonic()
    ev = lambda kind, dt: EngineCoreEvent(kind, t + dt)
    first = [
        EngineCoreOutput(
            rid,
            [5, 6] if i % 2 else [5],
            events=[ev(T.QUEUED, 0.001), ev(T.SCHEDULED, 0.002)],
            prefill_stats=PrefillStats(num_prompt_tokens=8, num_computed_tokens=8 - i % 3, num_cached_tokens=i % 3),
        )
        for i, rid in enumerate(ids)
    ]
    op.process_outputs(first, t + 0.003)
    for k in range(4):
        op.process_outputs([EngineCoreOutput(rid, [7]) for rid in ids], t + 0.004 + k * 0.001)
    op.process_outputs([EngineCoreOutput(ids[0], [], events=[ev(T.PREEMPTED, 0.009)])], t + 0.0095)
    op.process_outputs([EngineCoreOutput(ids[0], [8], events=[ev(T.SCHEDULED, 0.010)])], t + 0.011)
    reasons = [FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT, FinishReason.ERROR]
    op.process_outputs(
        [EngineCoreOutput(rid, [9], finish_reason=reasons[i % 4]) for i, rid in enumerate(ids)], t + 0.012
    )


def test_vllm_outputs_are_unpacked_in_the_span_process_as_on_the_thread(tmp_path, monkeypatch):
    """vLLM's step payloads go to the span process as plain data (engine_hooks.api.plain_payload)
    and are unpacked there into the same spans the pipeline's thread builds from the engine's
    objects."""
    from engine_hooks.hot_path.hook_events import PLAIN_RAW
    from engine_hooks.vllm.frontend import expand_outputs, plain_outputs

    here, there = tmp_path / "here.jsonl", tmp_path / "there.jsonl"
    monkeypatch.setenv("OTEL_LLM_TRACES_FILE", str(there))
    inproc = TracingPipeline(FileSpanExporter(str(here)), engine="vllm", detail="steps")
    child = TracingPipeline(None, engine="vllm", detail="steps", span_process=True)
    try:
        _vllm_steps(EngineHooks(inproc, strict=True), 8)
        events = list(inproc.recorder._buf)
        for e in events:
            child.recorder.record(e)
        sent = child._calls.translate(list(events))
        assert sum(it[0] == PLAIN_RAW for it in sent) == 8  # every step, as plain data
        assert child._calls._to_plain == {expand_outputs: plain_outputs}
        for p in (inproc, child):
            p.flush()
        a, b = read_trace_file(here), read_trace_file(there)
        requests = [s for s in b if s.name == sc.SPAN_REQUEST]
        assert len(requests) == 8 and _comparable(b) == _comparable(a)
        by_id = {s.attributes[sc.REQUEST_ID]: s.attributes for s in requests}
        assert by_id["cmpl-1"][sc.CACHE_READ_INPUT_TOKENS] == 1 and by_id["cmpl-1"][sc.PREFILL_COMPUTED_TOKENS] == 7
        assert by_id["cmpl-0"][sc.REQUEST_INTERNAL_ID] == "cmpl-0-x1"
        assert [by_id[f"cmpl-{i}"][sc.FINISH_REASONS] for i in range(4)] == [["stop"], ["length"], ["abort"], ["error"]]
        assert any(s.name == sc.SPAN_PREEMPTION for s in b)
    finally:
        inproc.shutdown()
        child.shutdown()


def test_a_plain_payload_that_fails_costs_its_own_event_only(tmp_path, monkeypatch):
    """An expander the span process cannot import (a closure) runs in the engine's process; a
    ``to_plain`` that fails, and an expander that fails in the span process, each lose their own
    event, never the batch around it."""
    from engine_hooks.api import plain_payload
    from engine_hooks.hot_path.hook_events import RAW
    from engine_hooks.vllm.frontend import expand_outputs

    seen = []

    @plain_payload(lambda payload: payload * 2)
    def local(tracker, mono, payload):  # a closure: pickle cannot send it by name
        seen.append(payload)

    monkeypatch.setenv("OTEL_LLM_TRACES_FILE", str(tmp_path / "t.jsonl"))
    p = TracingPipeline(None, engine="toy", span_process=True)
    hooks = EngineHooks(p)
    feed(hooks, 2)
    p.recorder.record((RAW, 0, local, 21))
    p.recorder.record((RAW, 0, expand_outputs, (None, [], None, [object()])))  # to_plain fails here
    p.recorder.record((RAW, 0, expand_outputs, (None, 12345, None, None)))  # plain: fails over there
    feed(hooks, 2, start=10)
    p.flush()
    assert seen == [42]  # made plain, and expanded here
    assert p._calls.failed_expansions == 1
    assert _requests(tmp_path / "t.jsonl") == ["r0", "r1", "r10", "r11"]
    p.shutdown()
