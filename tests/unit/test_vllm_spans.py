"""vLLM's own ``llm_request`` span as an engine boundary (collector/pipeline/vllm_spans.py): export requests
built by hand at the wire level in exactly the shape vLLM 0.32 sends (vllm/v1/engine/
output_processor.py ``do_tracing``: kind SERVER, start at arrival, ended a little after the last
output, latencies as double seconds, token counts as ints, ids as strings), through both walkers,
assembly and derivation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from support.otlp_helpers import body, records, span

from otel_llm import semconv as sc

T0 = 1_750_000_000_000_000_000
MS = 1_000_000


def vllm_attrs(rid: str, ttft=0.05, e2e=0.25, queue=0.01, prefill=0.03, decode=0.19, prompt=40, completion=9):
    """vLLM's attributes for one request, seconds (None leaves one out)."""
    a = {
        sc.VLLM_TTFT: ttft,
        sc.VLLM_E2E: e2e,
        sc.VLLM_QUEUE: queue,
        sc.VLLM_PROMPT_TOKENS: prompt,
        sc.VLLM_COMPLETION_TOKENS: completion,
        sc.VLLM_PREFILL: prefill,
        sc.VLLM_DECODE: decode,
        "gen_ai.latency.time_in_model_inference": 0.22,
        sc.VLLM_REQUEST_ID: rid,
        "gen_ai.request.max_tokens": 9,
        "gen_ai.request.n": 1,
    }
    return {k: v for k, v in a.items() if v is not None}


def vllm_span(trace: int, rid: str, parent: int = 0, start_ns: int = T0, **kw) -> Span:
    a = vllm_attrs(rid, **kw)
    e2e = a.get(sc.VLLM_E2E, 0.25)
    end = start_ns + round(e2e * 1e9) + 300_000  # vLLM ends the span when it has built it
    return span(trace, 0xA0 + trace, sc.VLLM_SPAN_REQUEST, start_ns, end, a, parent=parent)


@pytest.mark.parametrize("walker", ["c", "python"])
def test_vllm_span_is_an_engine_record_with_vllms_own_numbers(walker):
    b, rm = records(body(vllm_span(1, "cmpl-1-0")), walker=walker)
    (r,) = b.records()
    assert (r.boundary, r.request_id, r.model, r.status) == ("engine", "cmpl-1-0", "vllm.llm_engine", "ok")
    assert r.ttft == pytest.approx(0.05, abs=1e-9) and r.e2e == pytest.approx(0.25, abs=1e-9)
    assert r.end_ns - r.submit_ns == 250 * MS  # vLLM's E2E, not the span's end after it
    assert (r.input_tokens, r.output_tokens) == (40, 9)
    assert r.tpot == pytest.approx(0.2 / 8, abs=1e-9)  # the mean TPOT: (E2E - TTFT) / (N - 1)
    assert (r.queue, r.prefill, r.decode) == pytest.approx((0.01, 0.03, 0.19), abs=1e-9)
    assert r.events_summarised and r.itl_max is None  # the two events are no ITL
    assert r.front_end is None and r.first_scheduled_ns is None and r.first_generated_ns is None
    assert len(rm.itl) == 0 and math.isnan(rm.itl_max[0])
    assert not r.violations


def test_a_trace_with_our_spans_is_derived_from_ours_alone():
    """vLLM's span beside ours in one trace (our hooks and vLLM's tracing both on, one traceparent):
    one engine record, ours, with its per-token events."""
    ours = span(
        7,
        0x10,
        sc.SPAN_REQUEST,
        T0,
        T0 + 200 * MS,
        {
            sc.REQUEST_ID: "cmpl-7-0",
            sc.TOKEN_EVENT_OFFSETS: [40 * MS, 60 * MS, 190 * MS],
            sc.TOKEN_EVENT_TOKENS: [1, 1, 1],
        },
    )
    b, rm = records(body(ours), body(vllm_span(7, "cmpl-7-0")))
    (r,) = b.records()
    assert r.ttft == pytest.approx(0.04) and r.itl_max == pytest.approx(0.13) and not r.events_summarised
    assert len(rm.itl) == 2


def test_vllm_span_under_a_client_span_pairs_and_decomposes_what_it_can():
    """A client that sent a traceparent (vLLM puts its span under it): the pair's TTFT parts are
    to_engine, front_end_queue (vLLM's TTFT less its prefill: the front end and the queue, which
    its span cannot place), prefill and delivery, summing exactly; the engine record keeps vLLM's
    queue, and the client's ITL stays per token."""
    client = span(
        3,
        0x33,
        sc.SPAN_CLIENT_REQUEST,
        T0 - 2 * MS,
        T0 + 256 * MS,
        {
            sc.REQUEST_ID: "c-3",
            sc.TOKEN_EVENT_OFFSETS: [54 * MS, 100 * MS, 255 * MS],
            sc.TOKEN_EVENT_TOKENS: [1, 4, 4],
        },
        kind=3,
    )
    b, _ = records(body(client, service="bench"), body(vllm_span(3, "cmpl-3-0", parent=0x33)))
    c, e = sorted(b.records(), key=lambda r: r.boundary)
    assert (c.boundary, e.boundary) == ("client", "engine") and c.paired and e.paired
    assert c.peer_request_id == "cmpl-3-0"
    assert c.to_engine == pytest.approx(0.002) and c.delivery == pytest.approx(0.054 - 0.002 - 0.05, abs=1e-9)
    assert e.queue == pytest.approx(0.01) and c.queue is None and c.front_end is None
    assert c.front_end_queue == e.front_end_queue == pytest.approx(0.05 - e.prefill, abs=1e-9)
    assert c.to_engine + c.front_end_queue + c.prefill + c.delivery == pytest.approx(c.ttft, abs=1e-9)
    assert c.itl_max == pytest.approx(0.155) and not c.events_summarised


@pytest.mark.parametrize(
    "kw, known",
    [
        (dict(ttft=None), dict(ttft=None, tpot=None)),
        (dict(e2e=None), dict(ttft=0.05, tpot=None)),
        (dict(completion=1), dict(ttft=0.05, tpot=None)),
        (dict(completion=0), dict(ttft=None, tpot=None)),
        (dict(ttft=float("nan")), dict(ttft=None, tpot=None)),
        (dict(ttft=-1.0), dict(ttft=None, tpot=None)),
        (dict(ttft=1e300), dict(ttft=None, tpot=None)),
        (dict(ttft=0.3), dict(ttft=None, tpot=None)),  # after the end
        (dict(queue="0.01", prefill=-0.1, decode=float("inf")), dict(ttft=0.05, tpot=0.025)),
        (dict(completion=-4, prompt="40"), dict(ttft=None, tpot=None)),
    ],
)
def test_attributes_absent_wrong_or_out_of_range_are_unknown(kw, known):
    b, _ = records(body(vllm_span(5, "r", **kw)))
    (r,) = b.records()
    for name, v in known.items():
        assert getattr(r, name) == (None if v is None else pytest.approx(v)), name
    assert r.itl_max is None
    if "queue" in kw:
        assert (r.queue, r.prefill, r.decode) == (None, None, None)
    if "prompt" in kw:
        assert r.input_tokens is None


def test_prometheus_histograms_take_vllm_spans_but_no_itl_from_them():
    from collector.exporters.prometheus import render
    from collector.pipeline.metrics_registry import MetricsRegistry

    reg = MetricsRegistry()
    b, rm = records(*(body(vllm_span(i, f"r{i}", start_ns=T0 + i * MS)) for i in range(1, 5)))
    reg.record(b, rm)
    text = render(reg.families)
    count = lambda name: sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"{name}_count{{")
    )
    assert count("gen_ai_server_time_to_first_token_seconds") == 4
    assert count("gen_ai_server_time_per_output_token_seconds") == 4
    assert count("llm_queue_duration_seconds") == 4 and count("llm_prefill_duration_seconds") == 4
    assert 'llm_usage_output_tokens_total{boundary="engine",model="vllm.llm_engine"} 36' in text
    for unknown in (
        "llm_inter_token_latency_seconds",
        "llm_inter_token_latency_max_seconds",
        "llm_frontend_duration_seconds",
    ):
        assert f"{unknown}_count{{" not in text, unknown
    assert np.isnan(rm.itl_max).all()


def test_analyze_counts_them_and_pools_no_itl_from_them():
    from otel_llm.metrics.summary import summarize

    b, _ = records(*(body(vllm_span(i, f"r{i}", start_ns=T0 + i * MS)) for i in range(1, 4)))
    s = summarize(b.timelines(epoch_ns=0))
    assert s.counts.summarised == 3 and s.counts.completed == 3
    assert s.latency["itl"].n == 0 and s.latency["ttft"].n == 3 and s.latency["tpot"].n == 3
