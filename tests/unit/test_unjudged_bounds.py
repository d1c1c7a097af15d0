"""A bound a request's source cannot tell is never a pass (#46 item 2): its verdict on that bound is
unknown, the request is not good, it is left out of attainment, and the summary says how many."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from otel_llm.metrics.slo import SLO
from otel_llm.metrics.summary import bound_checks, bound_judged, summarize
from otel_llm.metrics.summary_format import format_summary
from otel_llm.metrics.timeline import Timeline, TimelineBatch


def batch(summarised=(), unknown=()) -> TimelineBatch:
    """Four completed requests, tokens every 10 ms after a 50 ms TTFT, one with a 200 ms gap;
    ``summarised``: those whose source gives the first and last token only; ``unknown``: those whose
    token count the source does not say."""
    tls = []
    for i in range(4):
        times = [0.05 + 0.01 * k for k in range(5)]
        if i == 3:
            times[-1] += 0.2
        tls.append(Timeline(f"r{i}", 0.0, times[-1] + 0.001, "ok", tuple((t, 1) for t in times)))
    b = TimelineBatch.from_timelines(tls)
    if summarised:
        mask = np.zeros(4, bool)
        mask[list(summarised)] = True
        b = replace(b, summarised=mask)
    if unknown:
        mask = np.zeros(4, bool)
        mask[list(unknown)] = True
        b = replace(b, tokens_unknown=mask)
    return b


def test_every_request_judged_attainment_as_before():
    g = summarize(batch(), slo=SLO(itl_max=0.1)).goodput
    assert (g.good, g.unjudged, g.attainment) == (3, 0, pytest.approx(0.75))


def test_a_summarised_request_cannot_pass_an_itl_bound_and_is_left_out_of_attainment():
    s = summarize(batch(summarised=(0, 1)), slo=SLO(itl_max=0.1))
    g = s.goodput
    assert g.good == 1 and g.unjudged == 2 and g.unjudged_by_bound == {"itl_max": 2}
    assert g.attainment == pytest.approx(0.5)  # r2 good, r3 not: of the two judged
    assert g.attainment_by_bound == {"itl_max": pytest.approx(0.5)}
    text = format_summary(s)
    assert "1 of 2 completed and judged; 2 left out" in text and "itl_max 2 (their source gives" in text


def test_nothing_judged_gives_no_attainment_not_100_percent():
    g = summarize(batch(summarised=(0, 1, 2, 3)), slo=SLO(itl_max=0.001)).goodput
    assert g.good == 0 and g.attainment is None and g.unjudged == 4
    assert g.requests_per_s is None and g.output_tokens_per_s is None  # unknown, not 0 requests/s


def test_a_bound_the_source_can_tell_is_judged_as_usual_beside_one_it_cannot():
    b = batch(summarised=(0,))
    g = summarize(b, slo=SLO(ttft=0.1)).goodput  # TTFT is known for a summarised request
    assert g.unjudged == 0 and g.good == 4


def test_an_unknown_token_count_cannot_pass_a_tpot_bound():
    rm_slo = SLO(tpot=1.0)
    s = summarize(batch(unknown=(1,)), slo=rm_slo)
    assert s.goodput.unjudged_by_bound == {"tpot": 1} and s.goodput.good == 3
    assert s.counts.tokens_unknown == 1 and s.output_tokens_in_window == 15  # r1's 5 not counted


def test_bound_checks_never_pass_what_bound_judged_says_is_unknown():
    from otel_llm.metrics.request_math import request_metrics

    rm = request_metrics(batch(summarised=(2,), unknown=(3,)))
    slo = SLO(ttft=1.0, tpot=1.0, itl_max=1.0, e2e=1.0)
    judged, checks = bound_judged(rm, slo), bound_checks(rm, slo)
    for name in slo.bounds:
        assert not (checks[name] & ~judged[name]).any(), name
    assert judged["itl_max"].tolist() == [True, True, False, True]
    assert judged["tpot"].tolist() == [True, True, True, False]


def test_stalls_and_preemptions_of_vllms_own_spans_are_unknown_not_0():
    """vLLM's own span (no hooks) says neither each token's time nor its preemptions: compare's
    stall is unknown, not none, the store's preemptions NULL, and the metrics count neither (#46
    item 3). Shaped at the wire level as vLLM 0.x emits it, under our client's span."""
    from support.otlp_helpers import body, records, span

    from collector.analysis.compare import compare, summarize_comparison
    from collector.pipeline.metrics_registry import MetricsRegistry
    from otel_llm import semconv as sc

    t0, ms = 1_750_000_000_000_000_000, 1_000_000
    client = span(
        5, 1, sc.SPAN_CLIENT_REQUEST, t0, t0 + 400 * ms,
        {sc.REQUEST_ID: "cmpl-1", sc.TOKEN_EVENT_OFFSETS: [50 * ms, 60 * ms, 300 * ms, 310 * ms],
         sc.TOKEN_EVENT_TOKENS: [1, 1, 1, 1]},
        kind=3,
    )  # fmt: skip
    vllm = span(
        5, 2, "llm_request", t0 + 5 * ms, t0 + 305 * ms,
        {"gen_ai.request.id": "cmpl-1", "gen_ai.latency.time_to_first_token": 0.04, "gen_ai.latency.e2e": 0.3,
         "gen_ai.latency.time_in_queue": 0.001, "gen_ai.latency.time_in_model_prefill": 0.02,
         "gen_ai.latency.time_in_model_decode": 0.26, "gen_ai.usage.completion_tokens": 4,
         "gen_ai.usage.prompt_tokens": 8},
        parent=1, kind=2,
    )  # fmt: skip
    b, rm = records(body(client, service="app"), body(vllm, service="vllm"))
    got = {r.boundary: r for r in b.records()}
    e, c = got["engine"], got["client"]
    assert e.events_summarised and c.paired
    assert e.preemptions is None and e.preemption_time is None and c.preemptions is None
    # the TTFT's parts sum exactly: what vLLM's span cannot place is one named part (#46 item 1)
    assert e.queue == pytest.approx(0.001) and e.front_end_queue == pytest.approx(0.04 - 0.02)
    assert c.queue is None and c.front_end is None and c.front_end_queue == e.front_end_queue
    assert c.to_engine + c.front_end_queue + c.prefill + c.delivery == pytest.approx(c.ttft, abs=1e-9)
    row = compare(b.records()).rows[0]
    assert row.parts_sum_minus_ttft == pytest.approx(0.0, abs=1e-9)
    assert list(row.parts) == ["to_engine", "front_end_queue", "prefill", "delivery"]
    cmp = compare(b.records(), stall_threshold=0.1)
    assert [r.stall for r in cmp.rows] == ["unknown"]  # the client's 240 ms gap: whose, vLLM's span cannot say
    assert summarize_comparison(cmp).stalls["unknown"] == 1
    reg = MetricsRegistry()
    reg.record(b, rm)
    assert sum(reg.stalls.series.values()) == 0 and sum(reg.preemptions.series.values()) == 0


def test_an_engine_span_without_a_model_takes_its_clients():
    """vLLM's own span names no model: paired, the engine record (and the metrics' model label)
    take what the request asked for, not the service name (#46 item 6)."""
    from support.otlp_helpers import body, records, span

    from otel_llm import semconv as sc

    t0, ms = 1_750_000_000_000_000_000, 1_000_000
    client = span(
        6, 1, sc.SPAN_CLIENT_REQUEST, t0, t0 + 100 * ms,
        {sc.REQUEST_ID: "cmpl-2", sc.REQUEST_MODEL: "tiny-llama", sc.TOKEN_EVENT_OFFSETS: [50 * ms],
         sc.TOKEN_EVENT_TOKENS: [1]},
        kind=3,
    )  # fmt: skip
    vllm = span(
        6, 2, "llm_request", t0 + 5 * ms, t0 + 95 * ms,
        {"gen_ai.request.id": "cmpl-2", "gen_ai.latency.time_to_first_token": 0.04, "gen_ai.latency.e2e": 0.09,
         "gen_ai.usage.completion_tokens": 1},
        parent=1, kind=2,
    )  # fmt: skip
    alone = span(
        7, 3, "llm_request", t0, t0 + 90 * ms,
        {"gen_ai.request.id": "cmpl-3", "gen_ai.latency.time_to_first_token": 0.04, "gen_ai.latency.e2e": 0.09},
        kind=2,
    )  # fmt: skip
    b, _ = records(body(client, service="app"), body(vllm, alone, service="unknown_service:python"))
    models = {(r.boundary, r.request_id): r.model for r in b.records()}
    assert models == {
        ("client", "cmpl-2"): "tiny-llama",
        ("engine", "cmpl-2"): "tiny-llama",
        ("engine", "cmpl-3"): "unknown_service:python",  # unpaired: nothing said the model
    }


def test_a_first_token_time_the_source_does_not_give_cannot_pass_or_fail_a_ttft_bound():
    """A GenAI client span without time_to_first_chunk (2.4b0): no token event, its request had
    tokens all the same: a TTFT bound cannot judge it (the review found it counted failed); a
    request of our own with no token at all still fails the bound."""
    tls = [Timeline("ours-none", 0.0, 0.1, "ok", ()), Timeline("theirs", 0.0, 0.1, "ok", ())]
    b = replace(TimelineBatch.from_timelines(tls), summarised=np.array([False, True]))
    g = summarize(b, slo=SLO(ttft=1.0)).goodput
    assert g.unjudged_by_bound == {"ttft": 1} and g.good == 0 and g.attainment == 0.0  # ours: judged, failed
    g = summarize(replace(b, summarised=np.array([True, True])), slo=SLO(ttft=1.0)).goodput
    assert g.unjudged == 2 and g.attainment is None
