"""Sweeps and the capacity search (docs/metrics/capacity.md): the pure parts against known answers,
and otel-llm bench --sweep / --find-capacity end to end against the fake streaming server. The
real-engine search is tests/test_capacity_vllm.py."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from span_records import read_trace_file

from otel_llm.capacity import (
    CapacitySearch,
    Sweep,
    first_failed_bound,
    part_that_grew,
    requests_per_point,
    wilson,
    wilson_half_width,
)


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
        "--format",
        "json",
        env={"OTEL_TRACES_EXPORTER": "none"},
    )
    out = json.loads(proc.stdout)
    c = out["conclusion"]
    assert [p["rate"] for p in out["points"]] == [8, 16, 32] and all(p["passed"] for p in out["points"])
    assert c["capacity_rate_per_s"] == 32 and c["stopped"] == "passed at max rate"
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
