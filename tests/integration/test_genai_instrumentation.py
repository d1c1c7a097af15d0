"""The OpenTelemetry project's own instrumentation of the openai SDK as the client boundary (#49),
installed from PyPI at its pinned working versions (``opentelemetry-instrumentation-openai-v2``
2.4b0, ``opentelemetry-instrumentation-httpx`` 0.66b2), against a real traced vLLM server and a
real collector, the way an application that already traces its model calls runs:

* streamed and non-streamed ``chat.completions.create``, with and without
  ``stream_options.include_usage``, some under one application span;
* without the httpx instrumentation (no ``traceparent`` reaches the server: the collector pairs
  each call by its response id) and with it (paired by trace);
* a legacy ``completions.create``, which the instrumentation does not wrap: no client record.

Every client record is paired with its server and engine records; its token count is the engine's
where usage was sent and unknown (never 0) where not. Run with ``-s`` to see the counts and what
``compare`` prints for one request."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time

import httpx
import pytest
from conftest import start_vllm_server, traced_server_env
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from support.otlp_helpers import store_records

from collector.analysis.compare import compare
from collector.pipeline.assembly import AssemblyConfig

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


def calls(client, model: str, prompt: str, tracer, stream: bool, usage: bool | None, n: int, under: str | None):
    """``n`` chat calls (``under``: in one application span of that name); their response ids."""
    ids = []

    def one():
        kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=6)
        if stream:
            kw["stream"] = True
            if usage is not None:
                kw["stream_options"] = {"include_usage": usage}
            got = None
            for chunk in client.chat.completions.create(**kw, extra_body={"ignore_eos": True}):
                got = chunk.id
            ids.append(got)
        else:
            ids.append(client.chat.completions.create(**kw, extra_body={"ignore_eos": True}).id)

    if under is None:
        for _ in range(n):
            one()
    else:
        with tracer.start_as_current_span(under):
            for _ in range(n):
                one()
    return ids


def test_the_official_openai_instrumentation_pairs_by_response_id_and_keeps_unknown_counts_unknown(
    make_collector, tiny_model
):
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

    from engine_hooks.tiny_model import prompt, stop_cpu_server

    c = make_collector(assembly=AssemblyConfig(grace_s=0.5, peer_wait_s=8.0, timeout_s=30.0))
    http_port = c.receivers[1].address[1]
    server, base_url = start_vllm_server(tiny_model, traced_server_env(c))
    tp = TracerProvider(resource=Resource({"service.name": "chat-app"}))
    # the SDK's default export delay (5 s): the application's spans come after the engine's
    tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"http://127.0.0.1:{http_port}/v1/traces")))
    tracer = tp.get_tracer("chat-app")
    inst = OpenAIInstrumentor()
    inst.instrument(tracer_provider=tp)
    text = prompt(12)
    want: dict[str, tuple[str, bool]] = {}  # response id -> (how it should pair, whether usage was sent)
    try:
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
        # the case: 8 streamed calls without usage, 5 on their own and 3 under one span
        for rid in calls(client, tiny_model, text, tracer, True, None, 5, None):
            want[rid] = ("id", False)
        for rid in calls(client, tiny_model, text, tracer, True, None, 3, "chain.run"):
            want[rid] = ("id", False)
        for rid in calls(client, tiny_model, text, tracer, True, True, 2, "chain.run"):
            want[rid] = ("id", True)
        for rid in calls(client, tiny_model, text, tracer, False, None, 2, None):
            want[rid] = ("id", True)  # a response not streamed always carries its usage
        # a legacy completion: the instrumentation does not wrap it (no client record)
        legacy = client.completions.create(model=tiny_model, prompt=text, max_tokens=4).id
        # with the httpx instrumentation the trace context reaches the server: paired by trace
        HTTPXClientInstrumentor().instrument(tracer_provider=tp)
        try:
            # openai 3.x sends through httpx2, which the httpx instrumentation does not see: an
            # httpx.Client given to the SDK is how its requests carry the trace context
            traced = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, http_client=httpx.Client())
            for rid in calls(traced, tiny_model, text, tracer, True, None, 2, "agent.turn"):
                want[rid] = ("trace", False)
            for rid in calls(traced, tiny_model, text, tracer, True, True, 1, None):
                want[rid] = ("trace", True)
            for rid in calls(traced, tiny_model, text, tracer, False, None, 1, None):
                want[rid] = ("trace", True)
        finally:
            HTTPXClientInstrumentor().uninstrument()
        tp.force_flush()
        deadline = time.monotonic() + 60
        while c.records_derived < 3 * len(want) + 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        c.store_writer.drain()
    finally:
        inst.uninstrument()
        tp.shutdown()
        stop_cpu_server(server)
    recs = store_records(c.config.store)
    clients = {r.request_id: r for r in recs if r.boundary == "client"}
    engines = {r.request_id: r for r in recs if r.boundary == "engine"}
    servers = {r.request_id: r for r in recs if r.boundary == "server"}
    assert len(want) == 16 and set(clients) == set(want), (sorted(clients), sorted(want))
    # the legacy call: the server's and engine's records alone (vLLM's completion ids: <id>-<choice>)
    assert [k for k in engines if k.startswith(legacy)] and not [k for k in clients if k.startswith(legacy)]
    for rid, (how, usage) in want.items():
        cl, en = clients[rid], engines[rid]
        assert cl.paired and en.paired and (cl.paired_by, en.paired_by) == (how, how), (rid, cl.paired_by)
        assert cl.peer_request_id == en.request_id == rid and rid in servers
        assert en.output_tokens == 6
        assert cl.output_tokens == (6 if usage else None), (rid, cl.output_tokens)  # unknown, never 0
        assert cl.e2e > 0 and cl.ttft is None  # 2.4b0 records no first-chunk time: unknown
        assert cl.queue == en.queue and cl.prefill == en.prefill and cl.prefill is not None
    by_span = {}
    for r in clients.values():
        by_span.setdefault(r.caller_span_id, []).append(r)
    # each application span's calls name it at every boundary, paired by id or by trace
    for calls_under in (x for k, x in by_span.items() if k is not None):
        for cl in calls_under:
            assert engines[cl.request_id].caller_span_id == cl.caller_span_id
    assert sorted(len(v) for k, v in by_span.items() if k is not None) == [2, 2, 3]  # chain, chain, agent turn
    counters = c.self_counters()
    assert counters["assembly_spans_paired_by_id"] == 12
    cmp = compare(recs)
    assert len(cmp.pairs) == 16
    unpaired = (
        sqlite3.connect(c.config.store)
        .execute("SELECT COUNT(*) FROM requests WHERE paired = 0 AND boundary != 'server'")
        .fetchone()
    )
    assert unpaired == (1,)  # the legacy call's engine record
    print(f"\nrecords: {len(recs)}; client records paired {sum(r.paired for r in clients.values())} of {len(clients)}")
    print("unpaired client or engine records (the legacy call's engine record):", unpaired[0])
    print(
        "client output_tokens:",
        sorted(((r.paired_by, str(r.output_tokens)) for r in clients.values()), key=str),
    )
    # what compare prints for the three calls under one span, paired by id (their trace's requests)
    chain = next(r.trace_id for r in clients.values() if want[r.request_id] == ("id", False) and r.caller_span_id)
    cli = [sys.executable, "-m", "otel_llm", "compare", "--store", c.config.store, "--trace", chain, "--top", "3"]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    assert "paired requests: 3 (3 by the client's response id" in out.stdout
