"""Capacity that means sustained load, against a real vLLM server (CPU, the tiny Llama, at most 4
sequences at once, no tracing: nothing but vLLM and bench share the machine's two cores).

With an SLO that every request meets however long it waits (TTFT within 60 s), only keeping up
decides a point: the capacity is the rate the server sustains. The search's answer is checked
against longer points on either side of it (a sweep of 20 s points, a quarter settling): one two
resolution steps below the answer is sustained, one two steps above the lowest failing rate is
not. Two steps, not one: on this 2-core machine the server and bench share the CPU, and the rate
the server sustains drifts by 20-30% from one minute to the next (17 to 27 requests/s within one
search, measured; in one CI run the search's points saw 8.7 requests/s completed and a longer
point a minute later sustained 12.0 at one step above); that the search lands within one step of
a known capacity is tested against a simulated server (tests/unit/test_capacity.py). Before points
measured a steady state, every rate up to --max-rate passed (a burst the server absorbs looked
like a sustained rate)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, start_vllm_server

from engine_hooks.tiny_model import stop_cpu_server

pytestmark = pytest.mark.slow

SEQS = 4
RES = 0.25


@pytest.fixture(scope="module")
def server(tiny_model):
    proc, base_url = start_vllm_server(tiny_model, {}, kv_bytes=16 * 2**20, extra_args=["--max-num-seqs", str(SEQS)])
    try:
        yield {"url": base_url, "model": tiny_model}
    finally:
        stop_cpu_server(proc)


def bench(t, *args):
    common = ("--base-url", t["url"], "--model", t["model"], "--input-tokens", "32", "--output-tokens", "32")
    out = run_cli("bench", *common, "--warmup", "2", *args, "--format", "json", env={"OTEL_TRACES_EXPORTER": "none"})
    return json.loads(out.stdout)


def _says(p: dict) -> str:
    st = p["steady_state"]
    return (
        f"rate {p['rate']:g}: offered {st['offered_per_s']:.1f}/s, completed {st['completed_per_s']:.1f}/s, "
        f"in flight {st['in_flight_start']} -> {st['in_flight_end']} (growth {st['growth']:+.1f}, allowed "
        f"{st['growth_tolerance']:.1f}), attainment {p['attainment_of_sent']:.2f}: "
        + ("pass" if p.get("passed", st["keeps_up"]) else "fail")
    )


def test_the_search_answers_the_sustained_rate_not_a_burst(server):
    """Started far above the server (64 requests/s against a few dozen at most): the burst the
    server's queue absorbs does not pass the first point; it fails on what it could not keep up
    with, and the next point is lower. The search then brackets the rate the server sustains, and
    longer points on either side of its answer agree (one search, not two: a minute less of the
    suite)."""
    got = bench(
        server,
        *("--find-capacity", "--slo", "ttft=60", "--start-rate", "64", "--resolution", str(RES)),
        *("--min-point-duration", "12", "--attainment-error", "0.15", "--max-points", "9"),
        *("--run-id", "steady"),
    )
    points, end = got["points"], got["conclusion"]
    for p in points:  # every point said how it knew: offered vs completed, the number in flight
        print(_says(p), flush=True)
        st = p["steady_state"]
        assert p["passed"] == st["keeps_up"]  # the SLO itself never failed a point here
        if not st["keeps_up"]:
            assert st["in_flight_end"] > st["in_flight_start"]
    first = points[0]["steady_state"]
    assert not points[0]["passed"] and first["completed_per_s"] < first["offered_per_s"]
    assert [p["rate"] for p in points[:2]] == [64, 32]
    cap, hi = end["capacity_rate_per_s"], end["lowest_failing_rate_per_s"]
    print(f"the search: capacity {cap}, lowest failing {hi}, stopped: {end['stopped']}", flush=True)
    assert end["stopped"] == "bracketed" and hi / cap <= 1 + RES and not end["capacity_is_lower_bound"]
    # longer points on either side of the answer: the knee lies within the search's resolution
    below, above = round(cap / (1 + RES) ** 2, 3), round(hi * (1 + RES) ** 2, 3)
    sweep = bench(
        server, "--sweep", f"rate={below},{above}", "--slo", "ttft=60", "--min-point-duration", "20", "--settle", "0.25"
    )
    lo_p, hi_p = sweep["points"]
    print("longer points:", _says(lo_p), "|", _says(hi_p), flush=True)
    assert lo_p["steady_state"]["keeps_up"], "a rate below the answer was not sustained"
    assert not hi_p["steady_state"]["keeps_up"], "a rate above the lowest failing one was sustained"


def test_a_search_that_never_fails_says_at_least(server):
    """A ceiling below the server's capacity: the answer is a lower bound, and says so."""
    out = run_cli(
        "bench",
        *("--base-url", server["url"], "--model", server["model"], "--input-tokens", "32", "--output-tokens", "32"),
        *("--find-capacity", "--slo", "ttft=60", "--start-rate", "2", "--max-rate", "4"),
        *("--min-point-duration", "5", "--attainment-error", "0.15"),
        env={"OTEL_TRACES_EXPORTER": "none"},
    )
    assert "capacity: at least 4 req/s (the search's ceiling, --max-rate)" in out.stdout, out.stdout
    assert "kept up" in out.stdout and "completed" in out.stdout  # the table's steady-state columns
