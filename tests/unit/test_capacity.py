"""Sweeps and the capacity search (docs/metrics/capacity.md): the pure parts against known answers,
and otel-llm bench --sweep / --find-capacity end to end against the fake streaming server. The
real-engine search is tests/integration/test_capacity_vllm.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli

from otel_llm.bench.capacity import (
    CapacitySearch,
    Sweep,
    first_failed_bound,
    keeping_up,
    part_that_grew,
    requests_per_point,
    wilson,
    wilson_half_width,
)
from otel_llm.otlp.span_records import read_trace_file


def test_sweep_forms():
    assert Sweep.parse("rate=1,2,4,8") == Sweep("rate", (1.0, 2.0, 4.0, 8.0))
    assert Sweep.parse("rate=8, 2,2,4").values == (2.0, 4.0, 8.0)  # sorted, once each
    assert Sweep.parse("rate=geom:1:16:5").values == (1.0, 2.0, 4.0, 8.0, 16.0)
    assert Sweep.parse("concurrency=geom:1:64:4").values == (1.0, 4.0, 16.0, 64.0)
    assert Sweep.parse("concurrency=1.4,3").values == (1.0, 3.0)  # workers are whole
    assert Sweep.parse("rate=0.5").label(0.5) == "rate0.5"
    for bad in ("rate", "speed=1,2", "rate=", "rate=0,1", "rate=a", "rate=geom:4:2:3", "rate=geom:1:2", "rate=inf"):
        with pytest.raises(ValueError):
            Sweep.parse(bad)


def test_wilson_interval_and_point_size():
    lo, hi = wilson(90, 100, 0.95)
    assert (round(lo, 4), round(hi, 4)) == (0.8256, 0.9448)  # the textbook value
    assert wilson(0, 0) is None and wilson(10, 10)[1] == 1.0 and wilson(0, 10)[0] == 0.0
    for a, e in ((0.9, 0.1), (0.9, 0.05), (0.99, 0.05), (0.5, 0.1)):
        n = requests_per_point(a, e)
        assert wilson_half_width(a, n) <= e < wilson_half_width(a, n - 1)  # the fewest that suffice
    assert requests_per_point(0.9, 0.1) == 37 and requests_per_point(0.9, 0.05) == 141
    with pytest.raises(ValueError):
        requests_per_point(0.9, 0.6)


def _fifo(send: np.ndarray, service_s: float) -> np.ndarray:
    """End times of requests served one at a time, first come first served, ``service_s`` each."""
    end, free = np.empty_like(send), 0.0
    for i, t in enumerate(send):
        free = end[i] = max(t, free) + service_s
    return end


def test_a_server_that_keeps_up_and_one_that_falls_behind():
    rng = np.random.default_rng(1)
    send = np.cumsum(rng.exponential(1 / 10, 300))  # Poisson, 10 requests/s for about 30 s
    start, stop = send[0] + 0.25 * (send[-1] - send[0]), send[-1]
    ok = keeping_up(send, _fifo(send, 1 / 14), start, stop)  # serves 14/s: keeps up
    assert ok.keeps_up and abs(ok.completed_per_s - ok.offered_per_s) < ok.tolerance_per_s
    assert abs(ok.trend_per_s) < 0.5 and ok.in_flight_end < 10
    behind = keeping_up(send, _fifo(send, 1 / 7), start, stop)  # serves 7/s: 3/s more arrive than leave
    assert not behind.keeps_up and behind.completed_per_s == pytest.approx(7, abs=0.3)
    assert behind.trend_per_s == pytest.approx(3, abs=1) and behind.in_flight_end > behind.in_flight_start + 40
    # the burst: 37 requests "at 1000/s" that a server doing 80/s absorbs: not a sustained rate
    burst = np.arange(37) / 1000
    b = keeping_up(burst, _fifo(burst, 1 / 80), 0.0, burst[-1] + 1e-9)
    assert not b.keeps_up and b.in_flight_end > 30
    assert keeping_up([1.0], [2.0], 5.0, 6.0) is None  # nothing sent in the window


@pytest.mark.parametrize("load, fails_at_most, fails_at_least", [(0.5, 0, 0), (1.3, 50, 50)])
def test_the_verdict_on_a_simulated_batching_server(load, fails_at_most, fails_at_least):
    """A 4-slot server (service 0.08-0.14 s: about 36 requests/s), 12 s points of Poisson arrivals,
    the first quarter settling: at half its capacity no point of 50 falls behind; at 130% every one."""
    import heapq

    fails = 0
    for seed in range(50):
        rng = np.random.default_rng(seed)
        rate = 36 * load
        send = np.cumsum(rng.exponential(1 / rate, int(rate * 15)))
        send = send[send < 12]
        slots, end = [0.0] * 4, np.empty_like(send)
        for i, (t, service) in enumerate(zip(send, rng.uniform(0.08, 0.14, len(send)))):
            end[i] = max(t, heapq.heappop(slots)) + service
            heapq.heappush(slots, end[i])
        k = keeping_up(send, end, send[0] + 0.25 * (send[-1] - send[0]), send[-1] + 1e-9)
        fails += not k.keeps_up
    assert fails_at_least <= fails <= fails_at_most


def _simulated_point(rate: float, seed: int, seconds: float = 30.0) -> bool:
    """Did a 4-slot server (service 0.08-0.14 s: capacity 4 / 0.11 = 36.4 requests/s) keep up with
    Poisson arrivals at ``rate`` for ``seconds`` (the first quarter settling)?"""
    import heapq

    rng = np.random.default_rng(seed)
    send = np.cumsum(rng.exponential(1 / rate, int(rate * seconds * 1.3) + 10))
    send = send[send < seconds]
    slots, end = [0.0] * 4, np.empty_like(send)
    for i, (t, service) in enumerate(zip(send, rng.uniform(0.08, 0.14, len(send)))):
        end[i] = max(t, heapq.heappop(slots)) + service
        heapq.heappush(slots, end[i])
    return keeping_up(send, end, send[0] + 0.25 * (send[-1] - send[0]), send[-1] + 1e-9).keeps_up


def test_the_search_finds_a_known_capacity_within_its_resolution():
    """The search with steady-state points (30 s, the default), against a simulated server whose
    sustained capacity is known (36.4 requests/s): over 20 searches, every answer is within two
    resolution steps of it and at least 18 within one; never a burst's answer."""
    mu, res = 4 / 0.11, 0.1
    answers = []
    for seed in range(20):
        s = CapacitySearch(start=4, resolution=res)
        while (r := s.next_rate()) is not None:
            s.record(r, _simulated_point(r, seed * 100 + len(s.points)))
        assert s.stopped == "bracketed"
        answers.append(s.capacity / mu)
    assert all(1 / (1 + res) ** 2 <= a <= 1 + res for a in answers), answers
    assert sum(1 / (1 + res) <= a <= 1 + res for a in answers) >= 18, answers


def test_a_capacity_that_never_failed_is_said_as_a_lower_bound():
    from otel_llm.bench.bench_sweep import conclusion_text

    c = {"kind": "capacity", "slo": {"ttft": 0.2}, "attainment_target": 0.9, "capacity_rate_per_s": 1000.0}
    c |= {"lowest_failing_rate_per_s": None, "stopped": "passed at max rate", "points": 11, "resolution": 0.1}
    c |= {"min_requests_per_point": 37, "min_point_duration_s": 30, "settle": 0.25, "attainment_error": 0.1}
    c |= {"confidence": 0.95, "marginal_points": []}
    text = conclusion_text(c)
    assert "capacity: at least 1000 req/s (the search's ceiling, --max-rate)" in text
    assert "capacity: 1000 req/s" not in text


def _search(capacity: float, **kw) -> CapacitySearch:
    """Run a search against a deployment that passes exactly at rates <= ``capacity``."""
    s = CapacitySearch(**kw)
    while (r := s.next_rate()) is not None:
        s.record(r, r <= capacity)
    return s


@pytest.mark.parametrize("capacity", [0.3, 1.0, 3.7, 24.68, 100.0, 999.0])
def test_the_search_brackets_the_capacity_within_the_resolution(capacity):
    s = _search(capacity, start=1.0, resolution=0.1, max_points=30)
    assert s.stopped == "bracketed"
    assert s.capacity <= capacity < s.lowest_failing
    assert s.lowest_failing / s.capacity <= 1.1
    # doubling to the bracket, then halving it on a log scale: about log2(bracket / 10%) more points
    assert len(s.points) <= 14
    assert len({p.rate for p in s.points}) == len(s.points)  # no rate measured twice


def test_the_search_stops_at_its_bounds():
    s = _search(1e9, start=2.0, max_rate=8.0)
    assert s.stopped == "passed at max rate" and [p.rate for p in s.points] == [2.0, 4.0, 8.0]
    assert s.capacity == 8.0 and s.lowest_failing is None
    s = _search(0.0, start=2.0, min_rate=0.5)
    assert s.stopped == "failed at min rate" and [p.rate for p in s.points] == [2.0, 1.0, 0.5]
    assert s.capacity is None
    s = _search(50.0, start=1.0, max_points=3)
    assert s.stopped == "max points" and len(s.points) == 3 and s.capacity == 4.0


def test_a_pass_above_a_fail_does_not_raise_the_answer():
    s = CapacitySearch(start=4.0, target=0.9)
    s.record(4.0, True, 0.95, (0.8, 0.99))
    s.record(8.0, False, 0.5, (0.3, 0.7))
    s.record(16.0, True, 0.92, (0.85, 0.97))  # noise
    assert s.capacity == 4.0 and s.lowest_failing == 8.0
    assert s.next_rate() == pytest.approx(5.657)  # the geometric mean of the bracket
    assert [p.clear for p in s.points] == [False, True, False]  # 0.8 < 0.9: the first is marginal


def test_what_failed_first_and_what_grew():
    points = [
        {"rate": 4, "by_bound": {"ttft": 1.0, "tpot": 1.0}},
        {"rate": 16, "by_bound": {"ttft": 0.7, "tpot": 0.85}},
        {"rate": 8, "by_bound": {"ttft": 0.95, "tpot": 0.85}},
    ]
    assert first_failed_bound(points, 0.9) == (8, ["tpot"])
    assert first_failed_bound(points, 0.8) == (16, ["ttft"])
    assert first_failed_bound(points[:1], 0.9) is None
    low = {"queue": 0.001, "prefill": 0.010, "front_end": 0.002}
    high = {"queue": 0.120, "prefill": 0.012, "front_end": 0.002, "api_in": 0.5}
    assert part_that_grew(low, high) == ("queue", pytest.approx(0.119))
    assert part_that_grew({}, high) is None


BENCH = ("bench", "--model", "m", "--output-tokens", "4", "--input-tokens", "8")


def test_a_sweep_runs_each_point_as_a_run_of_its_own(server, tmp_path):
    traces, results = tmp_path / "spans.jsonl", tmp_path / "points.jsonl"
    proc = run_cli(
        *BENCH,
        "--base-url",
        server.base_url,
        "--sweep",
        "rate=20,40",
        "--num-requests",
        "6",
        "--warmup",
        "1",
        "--run-id",
        "sw",
        "--slo",
        "ttft=1",
        "--results",
        results,
        env={"OTEL_LLM_TRACES_FILE": str(traces)},
    )
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["point", "point", "sweep"]
    p20, p40, end = lines
    assert (p20["rate"], p40["rate"], p20["run_id"], p40["run_id"]) == (20, 40, "sw-rate20", "sw-rate40")
    for p in (p20, p40):
        assert p["client"]["counts"]["requests"] == 6 and p["conditions"]["warmup_requests_excluded"] == 1
        assert p["attainment_of_sent"] == 1.0 and p["attainment_interval"][1] == 1.0
    assert p40["conditions"]["nominal_rate_per_s"] == 40 and end["values"] == [20, 40]
    assert "Sweep over rate" in proc.stdout and "sw-rate20" not in proc.stdout  # the table shows the load
    assert len(server.requests) == 14  # 2 x (1 warm-up + 6)
    spans = read_trace_file(traces)
    runs = {}
    for s in spans:
        if s.name == "llm.client.request" and not s.attributes.get("llm.bench.warmup"):
            runs.setdefault(s.attributes["llm.bench.run_id"], set()).add(s.resource["llm.bench.nominal_rate_per_s"])
    assert runs == {"sw-rate20": {20}, "sw-rate40": {40}}  # each point's spans carry its own conditions
    assert sorted(s.attributes["llm.bench.run_id"] for s in spans if s.name == "llm.bench.run") == [
        "sw-rate20",
        "sw-rate40",
    ]


def test_a_capacity_search_that_never_fails_stops_at_the_max_rate(server, tmp_path):
    proc = run_cli(
        *BENCH,
        "--base-url",
        server.base_url,
        "--find-capacity",
        "--slo",
        "ttft=1",
        "--start-rate",
        "8",
        "--max-rate",
        "32",
        "--num-requests",
        "8",
        *("--min-point-duration", "0", "--settle", "0"),
        "--format",
        "json",
        env={"OTEL_TRACES_EXPORTER": "none"},
    )
    out = json.loads(proc.stdout)
    c = out["conclusion"]
    assert [p["rate"] for p in out["points"]] == [8, 16, 32] and all(p["passed"] for p in out["points"])
    assert c["capacity_rate_per_s"] == 32 and c["stopped"] == "passed at max rate" and c["capacity_is_lower_bound"]
    assert all(p["steady_state"]["keeps_up"] for p in out["points"])
    assert c["min_requests_per_point"] == 8 and c["attainment_error"] == pytest.approx(wilson_half_width(0.9, 8))


def test_a_capacity_search_below_the_min_rate(server):
    proc = run_cli(
        *BENCH,
        "--base-url",
        server.base_url,
        "--find-capacity",
        "--slo",
        "ttft=0.000001",
        "--start-rate",
        "40",
        "--min-rate",
        "20",
        "--attainment-error",
        "0.3",
        *("--min-point-duration", "0", "--settle", "0"),
        env={"OTEL_TRACES_EXPORTER": "none"},
    )
    assert "capacity: below 20 req/s (no measured rate met the SLO)" in proc.stdout
    assert "first bound to fail: ttft (at rate 20)" in proc.stdout
    assert len(server.requests) == 2 * requests_per_point(0.9, 0.3)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--find-capacity"], "--find-capacity needs --slo"),
        (["--rate", "1", "--results", "x.jsonl"], "--results goes with --sweep or --find-capacity"),
        (["--rate", "1", "--store", "x.db"], "--store goes with --sweep or --find-capacity"),
        (["--sweep", "speed=1"], "--sweep: 'speed=1': expected"),
        (["--sweep", "rate=1,2", "--output", "t.jsonl"], "--output writes one run's timelines"),
        (["--find-capacity", "--slo", "ttft=1", "--start-rate", "0.01"], "--min-rate <= --start-rate"),
        (["--find-capacity", "--slo", "ttft=1", "--attainment", "1.5"], "0 < --attainment <= 1"),
        (["--sweep", "concurrency=1,2", "--max-concurrency", "2"], "a concurrency sweep is closed loop"),
        (["--sweep", "rate=1", "--rate", "2"], "not allowed with argument"),
    ],
)
def test_sweep_option_errors(flags, message):
    proc = run_cli("bench", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", *flags, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
