"""SGLang's own tracing as an engine boundary (collector/pipeline/sglang_spans.py), from spans in exactly
SGLang's shapes (tests/support/sglang_fixture.py) at each trace level, through both walkers, assembly and
derivation; paired with a client whose traceparent SGLang's root inherited."""

from __future__ import annotations

import time

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, set_span_in_context
from support.otlp_helpers import provider, records
from support.sglang_fixture import MS, SGLangRequest, emit

from otel_llm import semconv as sc


def bodies(level: int, reqs, client_events=None, service="sglang") -> list[bytes]:
    mem = InMemorySpanExporter()
    tp = provider(mem, service)
    tracer = tp.get_tracer("sglang server")
    t0 = time.time_ns()
    for k, r in enumerate(reqs):
        base = t0 + k * 1000 * MS
        ctx = None
        if client_events is not None:
            cl = tracer.start_span(
                sc.SPAN_CLIENT_REQUEST,
                kind=SpanKind.CLIENT,
                start_time=base - 2 * MS,
                attributes={
                    sc.REQUEST_ID: f"client-{r.rid}",
                    sc.TOKEN_EVENT_OFFSETS: [int((e + 2) * MS) for e in client_events],
                    sc.TOKEN_EVENT_TOKENS: [1] * len(client_events),
                },
            )
            ctx = set_span_in_context(cl)
        emit(tracer, r, base, level, context=ctx)
        if client_events is not None:
            cl.end(end_time=base + int((r.finish + 1) * MS))
    tp.shutdown()
    return [encode_spans(mem.get_finished_spans()).SerializeToString()]


@pytest.mark.parametrize("walker", ["c", "python"])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_each_level_gives_what_sglangs_stages_say(level, walker):
    b, _ = records(*bodies(level, [SGLangRequest("8f1e2d3c4b5a69788796a5b4c3d2e1f0")]), walker=walker)
    (r,) = b.records()
    assert (r.boundary, r.request_id, r.model, r.status) == (
        "engine",
        "8f1e2d3c4b5a69788796a5b4c3d2e1f0",
        "sglang",
        "ok",
    )
    assert r.e2e == pytest.approx(0.086)
    assert r.front_end == pytest.approx(0.004) and r.queue == pytest.approx(0.006)
    assert r.prefill == pytest.approx(0.020)
    assert r.first_generated_ns - r.submit_ns == 30 * MS and r.first_scheduled_ns - r.submit_ns == 10 * MS
    # SGLang never says when a token went out: no TTFT, TPOT or ITL under another name
    assert r.ttft is None and r.tpot is None and r.itl_max is None and r.event_times == []
    if level >= 2:
        assert r.decode == pytest.approx(0.055) and r.output_tokens == 6
    else:
        assert r.decode is None and r.output_tokens == 0
    assert not r.violations


def test_paired_with_the_client_the_ttft_splits_at_the_first_token_generated():
    """The client's TTFT = to_engine + front_end + queue + prefill + delivery (from the first token
    generated). The client's own ITL stays per token; the stall's layers need the engine's token
    events, which SGLang does not send: unknown."""
    client_events = [31.0, 36.0, 41.0, 46.0, 81.0, 86.0]  # ms after SGLang's arrival
    b, _ = records(*bodies(2, [SGLangRequest("r-1")], client_events=client_events))
    c, e = sorted(b.records(), key=lambda r: r.boundary)
    assert (c.boundary, e.boundary) == ("client", "engine") and c.paired and c.peer_request_id == "r-1"
    assert c.to_engine == pytest.approx(0.002) and c.delivery == pytest.approx(0.001)
    parts = c.to_engine + c.front_end + c.queue + c.prefill + c.delivery
    assert parts == pytest.approx(c.ttft, abs=1e-9) and c.ttft == pytest.approx(0.033)
    assert c.itl_max == pytest.approx(0.035) and c.stall_core_gap is None
    assert e.decode == pytest.approx(0.055) and e.output_tokens == 6


def test_a_req_span_without_rid_and_two_requests_in_one_trace():
    """A user's own span that happens to be named "Req ..." is no SGLang request; two SGLang roots
    in one trace take none of the trace's stage spans (whose they are cannot be told)."""
    mem = InMemorySpanExporter()
    tp = provider(mem, "app")
    tracer = tp.get_tracer("t")
    t0 = time.time_ns()
    tracer.start_span("Req to the billing service", start_time=t0).end(end_time=t0 + 5 * MS)
    with tracer.start_as_current_span("batch", start_time=t0):
        emit(tracer, SGLangRequest("a"), t0, 2, context=None)
        emit(tracer, SGLangRequest("b"), t0, 2, context=None)
    tp.shutdown()
    b, _ = records(encode_spans(mem.get_finished_spans()).SerializeToString())
    got = {r.request_id: r for r in b.records()}
    assert {"a", "b"} <= set(got)
    assert got["a"].queue is None and got["b"].queue is None and got["a"].e2e == pytest.approx(0.086)
