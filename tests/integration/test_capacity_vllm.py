"""The capacity search, a sweep and a replay against a real vLLM server (CPU, the tiny Llama,
traced through the plugin into an in-process collector): the search's answer agrees with the
points it measured, each point's engine side agrees with the engine's configuration, and a run
replayed from the collector's store sends its recorded lengths at its recorded offsets.

The server runs at most 4 sequences at once (``--max-num-seqs 4``), so past its capacity requests
wait in the scheduler's queue: the knee comes from the queue, and the search says so."""

from __future__ import annotations

import json
import math
import time

import pytest
from conftest import run_cli, start_collector, start_vllm_server

from engine_hooks.tiny_model import stop_cpu_server
from otel_llm.bench.capacity import wilson

pytestmark = pytest.mark.slow

SEQS = 4


@pytest.fixture(scope="module")
def traced(tiny_model, tmp_path_factory):
    """A collector (its store) and a traced vLLM server exporting to it; bench's OTLP env."""
    tmp = tmp_path_factory.mktemp("capacity")
    c, otlp = start_collector(str(tmp / "store.db"))
    server, base_url = start_vllm_server(
        tiny_model, {"OTEL_LLM_ENABLE": "1", **otlp}, kv_bytes=16 * 2**20, extra_args=["--max-num-seqs", str(SEQS)]
    )
    try:
        yield {"store": c.config.store, "env": otlp, "url": base_url, "model": tiny_model, "tmp": tmp}
    finally:
        stop_cpu_server(server)
        c.stop()


def bench(t, *args):
    common = ("--base-url", t["url"], "--model", t["model"], "--input-tokens", "32", "--output-tokens", "32")
    return run_cli("bench", *common, "--warmup", "2", *args, env=t["env"])


def test_the_capacity_search_agrees_with_the_points_it_measured(traced):
    results = traced["tmp"] / "capacity.jsonl"
    bench(
        traced,
        "--find-capacity",
        "--slo",
        "ttft=0.25",
        "--attainment",
        "0.9",
        "--attainment-error",
        "0.15",
        "--start-rate",
        "4",
        "--max-points",
        "8",
        "--min-point-duration",
        "2",
        "--settle",
        "0",
        "--run-id",
        "cap",
        "--store",
        traced["store"],
        "--results",
        results,
    )
    *points, end = [json.loads(x) for x in results.read_text().splitlines()]
    assert end["kind"] == "capacity" and all(p["kind"] == "point" for p in points)
    assert end["min_requests_per_point"] == 17  # Wilson at 0.9 within +-0.15
    for p in points:
        c = p["client"]
        sent, good = c["counts"]["requests"], c["goodput"]["good"]
        assert sent == max(17, math.ceil(p["rate"] * 2)) and p["attainment_of_sent"] == good / sent  # >= 2 s
        assert p["passed"] == (good / sent >= 0.9 and p["steady_state"]["keeps_up"])
        assert p["attainment_interval"] == pytest.approx(list(wilson(good, sent)))
    passed = [p["rate"] for p in points if p["passed"]]
    failed = [p["rate"] for p in points if not p["passed"]]
    assert failed, "the search never found a failing rate: the knee is below 4 req/s or above 8 points' reach"
    hi = min(failed)
    assert end["lowest_failing_rate_per_s"] == hi
    assert end["capacity_rate_per_s"] == max(r for r in passed if r < hi)  # the largest pass below the first fail
    if end["stopped"] == "bracketed":
        assert hi / end["capacity_rate_per_s"] <= 1.1
    assert end["first_failed_bound"]["bounds"] == ["ttft"]
    # each point from the store: every request at all three boundaries, the parts adding up, the
    # engine never running more than --max-num-seqs at once
    for p in points:
        prof = p["profile"]
        n = p["client"]["counts"]["requests"]
        assert prof["records"] == {"client": n, "server": n, "engine": n}, prof["records"]
        dec = prof["decomposition"]
        assert dec["requests"] == n
        assert sum(dec["parts_mean_s"].values()) == pytest.approx(dec["ttft_mean_s"], abs=1e-9)
        assert 1 <= prof["engine"]["batch_size_max"] <= SEQS
    # past the knee the queue is what grew: the scheduler held requests the batch had no room for
    low, knee = min(points, key=lambda p: p["rate"]), next(p for p in points if p["rate"] == hi)
    share = lambda p: p["profile"]["decomposition"]["share"]["queue"]
    assert share(knee) > share(low) + 0.2, (share(low), share(knee))
    assert "the part that grew most is queue" in end["why"], end["why"]
    # and the engine says why they waited: the batch was full (--max-num-seqs), at the knee more than below it
    waits = knee["profile"]["engine"]["wait_reasons"]
    assert max(waits, key=waits.get) == "max_num_seqs" and end["waiting_at_knee"]["reason"] == "max_num_seqs"
    assert waits["max_num_seqs"] > low["profile"]["engine"]["wait_reasons"].get("max_num_seqs", 0.0)
    # and analyze reads the same run from the store
    run = points[0]["run_id"]
    got = json.loads(
        run_cli("analyze", "--store", traced["store"], "--run", run, "--boundary", "engine", "--format", "json").stdout
    )
    assert got["counts"]["requests"] == points[0]["client"]["counts"]["requests"]


def test_a_concurrency_sweep_sees_the_engine_batch(traced):
    proc = bench(
        traced,
        "--sweep",
        "concurrency=1,8",
        "--num-requests",
        "24",
        "--run-id",
        "sweep",
        "--store",
        traced["store"],
        "--format",
        "json",
    )
    out = json.loads(proc.stdout)
    one, eight = out["points"]
    assert (one["run_id"], eight["run_id"]) == ("sweep-concurrency1", "sweep-concurrency8")
    e1, e8 = one["profile"]["engine"], eight["profile"]["engine"]
    # one worker: one request per step (a step may straddle the next request's arrival); eight workers
    # against 4 sequences: the batch is full most of the time and never over 4
    assert e1["batch_size_max"] <= 2 and e1["batch_size_mean"] < 1.2
    assert e8["batch_size_max"] == SEQS and e8["batch_size_mean"] > 2.5
    assert eight["profile"]["decomposition"]["share"]["queue"] > one["profile"]["decomposition"]["share"]["queue"]
    assert out["conclusion"]["kind"] == "sweep" and "from concurrency 1 to 8" in out["conclusion"]["why"]
    # the report draws each run of the store as a point against its send rate, from the same profile
    from collector.analysis.report import figures
    from collector.analysis.report_data import build_report
    from collector.storage.store import read_stores

    batch, steps = read_stores(traced["store"])
    d = build_report(batch, steps, source="test", slo=None)
    points = {p.run_id: p for p in d.sweep}
    assert {"sweep-concurrency1", "sweep-concurrency8"} <= set(points)
    for p, given in ((points["sweep-concurrency1"], one), (points["sweep-concurrency8"], eight)):
        dec = given["profile"]["decomposition"]
        assert p.requests == 24 and p.parts_mean == pytest.approx(dec["parts_mean_s"])
        assert p.batch_size_mean == pytest.approx(given["profile"]["engine"]["batch_size_mean"])
    fig = figures(d)["fig-sweep"]
    assert {t.name for t in fig.data} >= {"ttft p50", "tpot p99", "queue", "prefill"}


def test_a_run_replayed_from_the_store(traced):
    rec = traced["tmp"] / "recorded.jsonl"
    bench(
        traced,
        "--rate",
        "6",
        "--num-requests",
        "15",
        "--input-tokens",
        "uniform:8:64",
        "--output-tokens",
        "uniform:4:24",
        "--run-id",
        "to-replay",
        "--output",
        rec,
    )
    from collector.analysis.run_profile import records_of_run

    t_end = time.monotonic() + 30  # the collector stores a trace once its grace period is over
    while records_of_run(traced["store"], "to-replay")["client"] < 15 and time.monotonic() < t_end:
        time.sleep(0.5)
    assert records_of_run(traced["store"], "to-replay")["client"] == 15
    out = traced["tmp"] / "replayed.jsonl"
    proc = bench(
        traced,
        "--replay",
        traced["store"],
        "--replay-run",
        "to-replay",
        "--run-id",
        "replayed",
        "--output",
        out,
        "--format",
        "json",
    )
    cond = json.loads(proc.stdout)["conditions"]
    assert cond["replay_format"] == "store" and cond["replay_requests"] == 15
    recorded = sorted((json.loads(x) for x in rec.read_text().splitlines()), key=lambda r: r["submit"])
    replayed = sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda r: r["intended"])
    delay = cond["schedule_delay_s"]["max"]
    for a, b in zip(recorded, replayed, strict=True):
        # the lengths exactly: vLLM's usage counts the prompt it got and the tokens it made (ignore_eos)
        assert b["input_tokens"] == a["input_tokens"]
        assert sum(k for _, k in b["events"]) == sum(k for _, k in a["events"])
        # the recorded offsets (the store's ns, to the microsecond), sent within the schedule delay
        assert b["intended"] - replayed[0]["intended"] == pytest.approx(a["submit"] - recorded[0]["submit"], abs=2e-6)
        lag = (b["submit"] - replayed[0]["submit"]) - (a["submit"] - recorded[0]["submit"])
        assert abs(lag) <= delay + 1e-6  # each send within the schedule delay of its intended time
