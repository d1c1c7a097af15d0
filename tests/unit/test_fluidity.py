"""The fluidity index (docs/metrics/fluidity.md): the worked example through the CLI, the rules
one at a time, and the option's errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import run_cli

from otel_llm.metrics.fluidity import FluidityTarget, deadline_misses, fluidity_index

MS = 1_000_000
EXAMPLE = [
    {
        "id": "a",
        "submit": 0.0,
        "end": 1.2,
        "status": "ok",
        "events": [[0.5, 1], [0.55, 1], [0.6, 1], [1.0, 1], [1.05, 1]],
    },
    {
        "id": "b",
        "submit": 0.0,
        "end": 1.7,
        "status": "ok",
        "events": [[0.95, 1], [1.0, 1], [1.05, 1], [1.45, 1], [1.5, 1]],
    },
]


def test_the_worked_example_through_the_cli(jsonl):
    path = jsonl(EXAMPLE)
    got = json.loads(run_cli("analyze", path, "--fluidity", "ttft=1,tbt=0.1", "--format", "json").stdout)["fluidity"]
    assert got["index_mean"] == pytest.approx((1.0 + 2 / 3) / 2) and got["attainment"] == 0.5
    rates = got["deadline_miss_rate"]
    assert rates["n"] == 2 and rates["min"] == 0.0 and rates["max"] == pytest.approx(1 / 3)
    text = run_cli("analyze", path, "--fluidity", "ttft=1,tbt=0.1,target=0.6").stdout
    assert "fluidity index: mean 0.833 over 2 requests; fluid (index >= 0.6): 100.0%" in text


def test_each_rule():
    t, d = 1000 * MS, 100 * MS
    # a: early tokens bank slack that the 400 ms gap spends
    assert deadline_misses([500 * MS, 550 * MS, 600 * MS, 1000 * MS, 1050 * MS], [1] * 5, t, d) == (0, 5)
    # b: little slack: floor((400 - 150) / 100) = 2 deadlines missed, then the schedule restarts
    assert deadline_misses([950 * MS, 1000 * MS, 1050 * MS, 1450 * MS, 1500 * MS], [1] * 5, t, d) == (2, 6)
    # a late first token misses its own deadline and one per tbt of lateness: 1 + floor(350 / 100)
    assert deadline_misses([1350 * MS], [1], t, d) == (4, 4)
    # exactly on a deadline is on time
    assert deadline_misses([t, t + d], [1, 1], t, d) == (0, 2)
    # several tokens in one event: the first has the gap, the rest come with none (each banks a tbt)
    assert deadline_misses([500 * MS, 1400 * MS], [1, 4], t, d) == (4, 8)  # floor((900 - 500) / 100) = 4
    assert deadline_misses([500 * MS, 1400 * MS], [1, 1], t, d) == (4, 5)
    assert fluidity_index([], [], t, d) is None and fluidity_index([t], [1], t, d) == 1.0


def test_the_option_says_what_is_wrong(jsonl):
    path = jsonl(EXAMPLE)
    for bad, msg in (
        ("ttft=1", "both ttft= and tbt="),
        ("ttft=1,tbt=0", "tbt > 0"),
        ("tbt=0.1,ttft=x", "not a number"),
    ):
        proc = run_cli("analyze", path, "--fluidity", bad, check=False)
        assert proc.returncode == 2 and msg in proc.stderr, (bad, proc.stderr)
    assert FluidityTarget.parse("ttft=0.5, tbt=0.05, target=0.99") == FluidityTarget(0.5, 0.05, 0.99)


def _batch(rows):
    from otel_llm.metrics.timeline import Timeline, TimelineBatch

    return TimelineBatch.from_timelines(
        [Timeline(id=str(i), submit=0.0, end=ev[-1], status="ok", events=[(t, 1) for t in ev]) for i, ev in rows]
    )


def test_fluid_token_rate_worked_example():
    """docs/metrics/fluidity.md: 5 tokens 50 ms apart after a 100 ms first token, TTFT deadline 200 ms:
    every later token is on time while 4 (50 ms - tbt) <= 100 ms, so tbt* = 25 ms, 40 tokens/s."""
    from otel_llm.metrics.fluidity import FluidityTarget, fluid_token_rate
    from otel_llm.metrics.summary import summarize

    b = _batch([(0, [0.10, 0.15, 0.20, 0.25, 0.30])])
    rate = summarize(b, fluidity=FluidityTarget(0.2, 0.05)).fluidity.fluid_token_rate
    assert rate == pytest.approx(40.0, rel=2e-3)
    offs = np.round((b.event_time - 0.0) * 1e9).astype(np.int64)
    which = np.arange(1)
    # the first token late whatever tbt is: none
    assert fluid_token_rate(b.offsets, offs, b.event_tokens, which, FluidityTarget(0.05, 0.05)) is None
    # a loose TTFT deadline banks enough for every later token at any tbt: unbounded
    assert fluid_token_rate(b.offsets, offs, b.event_tokens, which, FluidityTarget(5.0, 0.05)) == math.inf
    assert fluid_token_rate(b.offsets, offs, b.event_tokens, which[:0], FluidityTarget(0.2, 0.05)) is None


def test_fluid_token_rate_takes_the_share_of_requests():
    """Two requests, one steady at 50 ms, one with a 300 ms stall: with share 1 the stalled one sets
    the rate; with share 0.5 the steady one does (its own 40 tokens/s, as above)."""
    from otel_llm.metrics.fluidity import FluidityTarget
    from otel_llm.metrics.summary import summarize

    rows = [(0, [0.10, 0.15, 0.20, 0.25, 0.30]), (1, [0.10, 0.15, 0.45, 0.50, 0.55])]
    half = summarize(_batch(rows), fluidity=FluidityTarget(0.2, 0.05, 0.9, 0.5)).fluidity
    both = summarize(_batch(rows), fluidity=FluidityTarget(0.2, 0.05, 0.9, 1.0)).fluidity
    assert half.fluid_token_rate == pytest.approx(40.0, rel=2e-3)
    # the stalled request: 100 ms banked, then gaps of 50 and 300 ms: its third token is on time while
    # 350 - 2 tbt <= 100, so tbt >= 125 ms (one miss in 6 deadlines is already below 0.9)
    assert both.fluid_token_rate == pytest.approx(8.0, rel=2e-3)
    out = run_cli("analyze", "-", "--fluidity", "ttft=0.2,tbt=0.05,share=1", input=_jsonl(rows)).stdout
    rate = float(out.split("fluid token generation rate: ")[1].split(" tokens/s")[0])
    assert 8.0 / 1.002 <= rate <= 8.0  # bisection to 0.1%, from the side that keeps every request fluid


def _jsonl(rows) -> str:
    import json

    return "".join(
        json.dumps({"id": str(i), "submit": 0.0, "end": ev[-1], "status": "ok", "events": [[t, 1] for t in ev]}) + "\n"
        for i, ev in rows
    )
