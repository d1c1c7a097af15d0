"""A trace holds many requests (#48), with a real traced vLLM server and the clients that do it: an
application (an agent, a chain) that calls the model ten times under one active span, for longer
than the collector's --trace-timeout, through
* otel-llm's ``instrument_openai`` on the openai SDK;
* the OpenTelemetry GenAI instrumentation of the openai SDK from PyPI
  (``opentelemetry-instrumentation-openai-v2``), the trace context put on each request by an httpx
  hook, as the httpx instrumentation does;
* no client spans at all against vLLM's own tracing (``--otlp-traces-endpoint``), the caller's
  ``traceparent`` on each request.
Every call is a record at each boundary, paired ten to ten, each naming the application's span;
Prometheus counts each once; a retried export of the client's spans (at once, and after the
other calls) is still counted once."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import start_vllm_server, traced_server_env
from opentelemetry import propagate
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from support.otlp_helpers import store_records

from collector.pipeline.assembly import AssemblyConfig
from otel_llm.client.traced import instrument_openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from agent_traces import requests_total

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

CALLS = 10
TIMEOUT_S = 3.0  # --trace-timeout: the ten calls take longer


class RetryingExporter(SpanExporter):
    """An OTLP exporter whose third export is sent twice at once (an answer lost, retried) and a
    third time after the run (a late retry, as a sender's queue replays)."""

    def __init__(self, inner: SpanExporter):
        self.inner, self.n, self.kept, self.lock = inner, 0, None, threading.Lock()

    def export(self, spans):
        with self.lock:
            self.n += 1
            if self.n == 3:
                self.kept = list(spans)
                self.inner.export(spans)
            return self.inner.export(spans)

    def retry_late(self) -> int:
        return 0 if self.kept is None else len(self.kept) * (self.inner.export(self.kept) == SpanExportResult.SUCCESS)

    def shutdown(self):
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def provider(http_port: int, name: str) -> tuple[TracerProvider, RetryingExporter]:
    exporter = RetryingExporter(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{http_port}/v1/traces"))
    tp = TracerProvider(resource=Resource({"service.name": name}))
    tp.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    return tp, exporter


def wait_for(c, store: str, n: int, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while c.records_derived < n and time.monotonic() - t0 < timeout:
        time.sleep(0.1)
    c.store_writer.drain()


def by_trace(recs, trace_id: str) -> dict[str, list]:
    out: dict[str, list] = {"client": [], "server": [], "engine": []}
    for r in recs:
        if r.trace_id == trace_id:
            out[r.boundary].append(r)
    return out


def test_ten_calls_under_one_span_are_ten_requests_at_each_boundary(make_collector, tiny_model, tmp_path):
    from engine_hooks.tiny_model import prompt, stop_cpu_server

    c = make_collector(assembly=AssemblyConfig(grace_s=0.5, peer_wait_s=6.0, timeout_s=TIMEOUT_S))
    http_port = c.receivers[1].address[1]
    server, base_url = start_vllm_server(tiny_model, traced_server_env(c, OTEL_LLM_SCHEDULE_DELAY="100"))
    try:
        # otel-llm's own client, in an agent loop under one span
        tp, ours = provider(http_port, "agent")
        client = instrument_openai(openai.OpenAI(base_url=base_url, api_key="x", max_retries=0), tracer_provider=tp)
        t0 = time.monotonic()
        with tp.get_tracer("agent").start_as_current_span("agent.run") as app:
            for _ in range(CALLS):
                stream = client.completions.create(
                    model=tiny_model, prompt=prompt(16), max_tokens=6, stream=True, extra_body={"ignore_eos": True}
                )
                for _ in stream:
                    pass
                time.sleep(0.3)
        took = time.monotonic() - t0
        ours_trace, ours_app = f"{app.get_span_context().trace_id:032x}", f"{app.get_span_context().span_id:016x}"
        tp.force_flush()

        # the OpenTelemetry GenAI instrumentation of the same SDK, a chain under one span
        from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

        tp2, theirs = provider(http_port, "chain")
        inst = OpenAIInstrumentor()
        inst.instrument(tracer_provider=tp2)
        try:
            hooked = httpx.Client(event_hooks={"request": [lambda req: propagate.inject(req.headers)]})
            genai = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, http_client=hooked)
            with tp2.get_tracer("chain").start_as_current_span("chain.run") as chain:
                for _ in range(CALLS):
                    stream = genai.chat.completions.create(
                        model=tiny_model,
                        messages=[{"role": "user", "content": prompt(12)}],
                        max_tokens=6,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True},
                    )
                    for _ in stream:
                        pass
                    time.sleep(0.3)
        finally:
            inst.uninstrument()
        theirs_trace, theirs_app = (
            f"{chain.get_span_context().trace_id:032x}",
            f"{chain.get_span_context().span_id:016x}",
        )
        tp2.force_flush()
        wait_for(c, c.config.store, 6 * CALLS)
        late = ours.retry_late() + theirs.retry_late()  # the same spans again, long after
        assert late > 0 and ours.n >= 3 and theirs.n >= 3
        time.sleep(1.0)
    finally:
        stop_cpu_server(server)
    wait_for(c, c.config.store, 6 * CALLS)
    assert took > TIMEOUT_S  # the calls of one trace spread over longer than --trace-timeout
    recs = store_records(c.config.store)
    for trace_id, app_id, genai in ((ours_trace, ours_app, False), (theirs_trace, theirs_app, True)):
        got = by_trace(recs, trace_id)
        assert {b: len(v) for b, v in got.items()} == {"client": CALLS, "server": CALLS, "engine": CALLS}, trace_id
        unpaired = [(r.boundary, r.request_id, r.submit_ns) for r in got["client"] + got["engine"] if not r.paired]
        assert unpaired == [], (trace_id, unpaired)  # which one says whether a race or a lost span
        assert len({r.request_id for r in got["client"]}) == CALLS
        assert {r.peer_request_id for r in got["client"]} == {r.request_id for r in got["engine"]}
        assert {r.caller_span_id for r in got["client"] + got["server"] + got["engine"]} == {app_id}
        # each call its own parts (2.4b0 records no first chunk: its TTFT is unknown, never 0)
        assert all(r.e2e > 0 and r.queue is not None and r.prefill is not None for r in got["client"])
        assert all((r.ttft is None) == genai for r in got["client"])
    assert requests_total(c) == {"client": 2 * CALLS, "server": 2 * CALLS, "engine": 2 * CALLS}
    counters = c.self_counters()
    assert counters["assembly_spans_late"] + counters["assembly_spans_duplicate"] >= 2  # the retries, dropped


def test_vllm_own_tracing_under_one_callers_trace(make_collector, tiny_model, tmp_path):
    """No hooks and no client spans: vLLM's own llm_request spans of ten calls under one caller's
    span, for longer than --trace-timeout, are ten engine records."""
    from engine_hooks.tiny_model import prompt, stop_cpu_server

    c = make_collector(assembly=AssemblyConfig(grace_s=0.5, peer_wait_s=2.0, timeout_s=TIMEOUT_S))
    extra = ["--otlp-traces-endpoint", f"http://127.0.0.1:{c.receivers[0].address[1]}"]
    server, base_url = start_vllm_server(tiny_model, {"OTEL_BSP_SCHEDULE_DELAY": "200"}, extra_args=extra)
    try:
        tp = TracerProvider()
        t0 = time.monotonic()
        with tp.get_tracer("app").start_as_current_span("app.run") as app, httpx.Client(timeout=60) as http:
            for _ in range(CALLS):
                headers: dict = {}
                propagate.inject(headers)
                body = {"model": tiny_model, "prompt": prompt(16), "max_tokens": 6, "ignore_eos": True}
                assert http.post(f"{base_url}/completions", json=body, headers=headers).status_code == 200
                time.sleep(0.4)
        took = time.monotonic() - t0
        wait_for(c, c.config.store, CALLS, timeout=30)
    finally:
        stop_cpu_server(server)
    assert took > TIMEOUT_S
    got = by_trace(store_records(c.config.store), f"{app.get_span_context().trace_id:032x}")
    assert len(got["engine"]) == CALLS and len({r.request_id for r in got["engine"]}) == CALLS
    assert {r.caller_span_id for r in got["engine"]} == {f"{app.get_span_context().span_id:016x}"}
    assert requests_total(c).get("engine") == CALLS
