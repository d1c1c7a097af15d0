"""An OTLP endpoint that accepts connections and never answers (a hung collector, a full proxy):
the engine side keeps one span process, its memory bounded by the export queue, drops and counts
what it cannot send, and its exit ends within one OTEL_LLM_EXIT_TIMEOUT, said in one line (#47,
items 3 and 4: span processes went 1 -> 2 -> 3 and a stop took 63 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import ROOT
from support.hook_feed import feed
from support.hung_endpoint import hung_endpoint as hung_port
from support.hung_endpoint import span_processes

from engine_hooks import EngineHooks, TracingPipeline
from engine_hooks.span_process.export_queue import ExportQueue


@pytest.fixture
def hung_endpoint(monkeypatch):
    """OTLP/HTTP export to a port that accepts every connection, reads nothing and never answers."""
    with hung_port() as port:
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_METRICS_EXPORTER": "none",
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("OTEL_LLM_TRACES_FILE", raising=False)
        yield env


def mine() -> set[int]:
    """This process's span processes."""
    return set(span_processes(os.getpid()).get(os.getpid(), ()))


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_a_hung_collector_keeps_one_span_process_and_exits_by_the_deadline(hung_endpoint, monkeypatch):
    """15 s of rounds against the hung endpoint: the span process keeps reading its pipe (its
    exporter waits on a thread of its own), so it is never retired and no second one starts; what
    the queue cannot hold is dropped and counted; shutdown ends within its deadline and the span
    process with it. Before: the pipe filled, each delivery gave up after OTEL_BSP_EXPORT_TIMEOUT and
    retired the child, and every retired child lived on with its backlog."""
    monkeypatch.setenv("OTEL_BSP_EXPORT_TIMEOUT", "500")
    monkeypatch.setenv("OTEL_LLM_EXPORT_QUEUE_SIZE", "2048")
    others = mine()  # other tests' span processes in this worker are not this pipeline's
    p = TracingPipeline(None, engine="toy", span_process=True)
    hooks = EngineHooks(p)
    most, rounds, worst = 0, 0, 0.0
    end = time.monotonic() + 15
    try:
        while time.monotonic() < end:
            feed(hooks, 200, start=1000 * rounds)
            t0 = time.monotonic()
            p.process()
            worst = max(worst, time.monotonic() - t0)
            rounds += 1
            most = max(most, len(mine() - others))
            time.sleep(0.02)
        assert p.sink.lost_events == 0, "a delivery to the span process was given up"
        assert (p.sink.starts, most) == (1, 1), f"{p.sink.starts} span processes started, {most} at once"
        assert worst < 0.5, f"a delivery took {worst:.2f} s"
        t0 = time.monotonic()
        p.shutdown(t0 + 2.0)
        took = time.monotonic() - t0
    finally:
        p.shutdown(time.monotonic())
    assert took < 2.0 + 0.5, f"shutdown took {took:.1f} s"
    assert mine() - others == set()  # the child too
    c = p.counters
    built = 200 * rounds
    assert c.requests_traced == built  # every request was built (and its spans dropped, counted)
    assert c.spans_exported == 0 and c.spans_dropped >= built, (c.spans_exported, c.spans_dropped, built)
    assert p.sink.killed == 0  # it stopped by itself at the deadline it was given


def test_in_process_export_never_waits_on_the_endpoint(hung_endpoint):
    """OTEL_LLM_SPAN_PROCESS=0: the round hands its spans to the export queue and returns; the queue
    holds at most its bound; shutdown closes it at the deadline, counting what it held."""
    p = TracingPipeline(None, engine="toy")
    p.use_env_exporter()
    assert isinstance(p.exporter, ExportQueue)
    p.exporter.max_spans = 1000
    hooks = EngineHooks(p)
    for k in range(5):
        feed(hooks, 100, start=1000 * k)
        t0 = time.monotonic()
        p.process()
        assert time.monotonic() - t0 < 1.0  # the OTLP exporter waits 10 s a try on this endpoint
    q = p.exporter
    assert q.pending <= 1000 and q.dropped_full > 0
    t0 = time.monotonic()
    p.shutdown(t0 + 0.5)
    assert time.monotonic() - t0 < 1.0
    assert q.exported == 0 and q.dropped == q.dropped_full + q.dropped_at_close > 0
    assert p.counters.spans_dropped == q.dropped


def test_a_queue_sends_in_order_and_counts_once():
    """A working exporter behind the queue: everything in order, counted exported once; a send
    stuck at the deadline is counted dropped there, not again when it ends."""
    got, release = [], threading.Event()

    class Slow:
        def export(self, spans):
            if spans[0] == "stuck":
                release.wait(5)
            got.extend(spans)
            from opentelemetry.sdk.trace.export import SpanExportResult

            return SpanExportResult.SUCCESS

        def shutdown(self):
            got.append("shutdown")

        def force_flush(self, timeout_millis=0):
            return True

    q = ExportQueue(Slow(), max_spans=10)
    for i in range(5):
        q.export([i, i])
    assert q.force_flush(5000) and got == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4] and q.exported == 10
    q.export(["stuck"])
    q.export(list(range(10)))  # 1 + 10 > 10: full
    assert q.dropped_full == 10
    time.sleep(0.1)  # the thread is in the stuck send
    assert q.close(time.monotonic() + 0.2) == 1
    release.set()
    time.sleep(0.2)
    assert (q.exported, q.dropped) == (10, 11)
    assert "shutdown" not in got  # not shut down under a send


def test_the_exit_waits_one_deadline_and_says_what_it_dropped(hung_endpoint, tmp_path):
    """A traced process ending normally with the endpoint hung: its exit (atexit) takes about
    OTEL_LLM_EXIT_TIMEOUT, not 30 s per stage, leaves no span process behind and says in one line
    what it dropped."""
    script = textwrap.dedent(
        f"""
        import atexit, os, sys, time
        marks = {{}}
        atexit.register(lambda: print(f"atexit {{time.monotonic() - marks['t0']:.2f}}", flush=True))  # runs last
        sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / "tests")!r})
        from engine_hooks import EngineHooks
        from support.hook_feed import feed
        hooks = EngineHooks(engine="toy")
        for k in range(5):
            feed(hooks, 100, start=1000 * k)
            hooks.pipeline.process()
        print(hooks.pipeline.sink._proc.pid, flush=True)
        atexit.register(lambda: marks.setdefault("t0", time.monotonic()))  # runs first
        """
    )
    env = {**os.environ, **hung_endpoint, "OTEL_LLM_EXIT_TIMEOUT": "1500"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = int(proc.stdout.split()[0])
    lines = [line for line in proc.stderr.splitlines() if "exit after" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "OTEL_LLM_EXIT_TIMEOUT=1500 ms" in lines[0] and " 0 spans exported" in lines[0], lines[0]
    assert "127.0.0.1" in lines[0]  # where it was sending
    exit_s = float(proc.stdout.split("atexit ")[1])
    assert exit_s < 1.5 + 0.5, f"the exit took {exit_s:.2f} s ({took:.1f} s in all)"
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
