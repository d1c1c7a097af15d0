"""A real Prometheus server (Debian's package) scrapes the collector; PromQL gives goodput."""

import time

import pytest
from conftest import promql
from support.otlp_helpers import Req, emit, grpc_exporter, provider

from otel_llm.metrics.slo import SLO

pytestmark = pytest.mark.slow


def test_promql_goodput(make_collector, prometheus):
    """Figure 5 at the client boundary: 10 completed, 8 meet TTFT <= 1 s and TPOT <= 50 ms."""
    c = make_collector(slos={"default": SLO(ttft=1.0, tpot=0.05)})
    prom = prometheus(c.prometheus.address[1])
    reqs = []
    for i in range(10):
        ttft, tpot = (1500 if i == 3 else 500), (70 if i == 7 else 30)
        ev = [(ttft + j * tpot, 1) for j in range(5)]
        reqs.append(
            Req(
                f"g{i}",
                client_events=ev,
                client_end=ev[-1][0] + 10,
                arrival=1,
                first_scheduled=2,
                first_generated=ttft - 2,
                engine_events=[(t - 1, k) for t, k in ev],
                engine_end=ev[-1][0] + 5,
            )
        )
    sel = 'boundary="client",model="tiny"'
    good_q = f'sum(llm_slo_good_requests_total{{{sel},slo="default"}})'

    def send_and_wait(batch, good_total):
        tp = provider(grpc_exporter(c.receivers[0].port))
        base = time.time_ns()
        for r in batch:
            emit(tp.get_tracer("t"), r, base)
        tp.shutdown()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            res = promql(prom, good_q)
            if res and float(res[0]["value"][1]) == good_total:
                return
            time.sleep(0.3)
        raise AssertionError(f"Prometheus never saw {good_total} good requests: {res}")

    # a running service: the series exist (one good request) before the measured load arrives,
    # as Prometheus takes a new series' first sample as its baseline
    send_and_wait([Req("warm-up")], 1)
    time.sleep(2.5)  # scraped at 1 good / 1 completed
    w0 = time.time()
    send_and_wait(reqs, 9)
    time.sleep(1.5)
    w1 = time.time()
    completed_q = f'sum(llm_requests_total{{{sel},status="ok"}})'
    attainment = promql(prom, f"{good_q} / {completed_q}")
    assert float(attainment[0]["value"][1]) == pytest.approx(9 / 11)  # 9 good of 11 completed, all time

    def at(q, t):
        return float(promql(prom, q, at=t)[0]["value"][1])

    # goodput over the window [w0, w1] holding figure 5's batch: the good counter's increase / T
    good = at(good_q, w1) - at(good_q, w0)
    completed = at(completed_q, w1) - at(completed_q, w0)
    assert (good, completed) == (8, 10)
    goodput, throughput = good / (w1 - w0), completed / (w1 - w0)
    assert goodput == pytest.approx(0.8 * throughput)
    # and PromQL's own rate over the last minute is positive and no more than the request rate
    rate_good = float(promql(prom, f'sum(rate(llm_slo_good_requests_total{{{sel},slo="default"}}[1m]))')[0]["value"][1])
    rate_ok = float(promql(prom, f'sum(rate(llm_requests_total{{{sel},status="ok"}}[1m]))')[0]["value"][1])
    assert 0 < rate_good <= rate_ok
    ttft_p = promql(
        prom,
        f"histogram_quantile(0.5, sum by (le) (rate(gen_ai_server_time_to_first_token_seconds_bucket{{{sel}}}[1m])))",
    )
    assert 0.25 <= float(ttft_p[0]["value"][1]) <= 0.5  # 9 of 10 TTFTs are 500 ms: within the (0.25, 0.5] bucket
