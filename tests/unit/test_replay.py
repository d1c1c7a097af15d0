"""otel-llm bench --replay (docs/metrics/capacity.md, "Replay") against the fake streaming server: a
recorded run replayed from its timelines file and from its trace file sends the same lengths at
the same offsets (within the schedule delay bench reports); a Mooncake trace's shared hash blocks
are shared prompt prefixes; the speed factor; bad files. The replay of a real vLLM run from a
collector store is in tests/integration/test_capacity_vllm.py."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from otel_llm.bench.replay import Replay, ReplayItem, detect


def bench(server, *args, env=None):
    return run_cli("bench", "--base-url", server.base_url, "--model", "m", *args, env=env)


def rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def bodies_in_send_order(server) -> list[dict]:
    """The bodies the fake server got, in the order bench sent them (its request ids count up:
    bench-SEED-0, -1, ...); the server's own log is in arrival order, which threads may swap."""

    def index(r):
        rid = {k.lower(): v for k, v in r["headers"].items()}["x-request-id"]
        return int(rid.rsplit("-", 1)[1])

    return [r["body"] for r in sorted(server.requests, key=index)]


def check_replayed(recorded: list[dict], replayed: list[dict], bodies: list[dict], delay_max: float) -> None:
    """The replay sent each recorded request's lengths, meant at its recorded offset, and sent it
    within the schedule delay of that."""
    assert len(replayed) == len(recorded) == len(bodies)
    rec = sorted(recorded, key=lambda r: r["submit"])
    rep = sorted(replayed, key=lambda r: r["intended"])
    t0, i0, s0 = rec[0]["submit"], rep[0]["intended"], rep[0]["submit"]
    for a, b, body in zip(rec, rep, bodies):
        assert len(body["prompt"]) == a["input_tokens"] == b["input_tokens"]
        assert body["max_tokens"] == sum(k for _, k in a["events"]) == sum(k for _, k in b["events"])
        assert b["intended"] - i0 == pytest.approx(a["submit"] - t0, abs=2e-6)  # meant at the recorded offset
        # sent at the recorded offset from the first, within the schedule delay (each request's, the first's
        # included, is between 0 and the reported max: their difference is no more than that max)
        assert abs((b["submit"] - s0) - (a["submit"] - t0)) <= delay_max + 1e-6


def test_a_recorded_run_replays_from_its_timelines_and_its_traces(server, tmp_path):
    rec, traces = tmp_path / "rec.jsonl", tmp_path / "rec-spans.jsonl"
    bench(
        server,
        "--rate",
        "25",
        "--num-requests",
        "12",
        "--input-tokens",
        "uniform:5:30",
        "--output-tokens",
        "uniform:2:9",
        "--seed",
        "3",
        "--output",
        rec,
        env={"OTEL_LLM_TRACES_FILE": str(traces)},
    )
    recorded = rows(rec)
    assert len({r["input_tokens"] for r in recorded}) > 3  # lengths that differ, so order matters
    for source in (rec, traces):
        server.requests.clear()
        out = tmp_path / f"replay-{source.stem}.jsonl"
        proc = bench(
            server, "--replay", source, "--output", out, "--format", "json", env={"OTEL_TRACES_EXPORTER": "none"}
        )
        cond = json.loads(proc.stdout)["conditions"]
        assert cond["arrival_process"] == "replay" and cond["replay_requests"] == 12
        assert cond["replay_format"] == ("timelines" if source == rec else "traces")
        bodies = bodies_in_send_order(server)
        check_replayed(recorded, rows(out), bodies, cond["schedule_delay_s"]["max"])


def test_a_mooncake_trace_shares_its_prefix_blocks_and_runs_at_its_speed(server, tmp_path):
    trace = tmp_path / "mooncake.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 400, "input_length": 9, "output_length": 2, "hash_ids": [7, 8, 9]},
        {"timestamp": 800, "input_length": 6, "output_length": 4, "hash_ids": [7, 5]},
        {"timestamp": 1200, "input_length": 5, "output_length": 1},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    bench(server, "--replay", trace, "--replay-block-size", "4", "--replay-speed", "2", "--output", out)
    sent = bodies_in_send_order(server)
    a, b, c, d = (r["prompt"] for r in sent)
    assert [len(p) for p in (a, b, c, d)] == [10, 9, 6, 5]
    assert [r["max_tokens"] for r in sent] == [3, 2, 4, 1]
    assert a[:8] == b[:8]  # blocks 7 and 8: the same ids
    assert a[:4] == c[:4] and a[4:6] != c[4:6]  # block 7 shared, then block 5
    assert d != a[:5]  # no hash ids: drawn for the request
    got = sorted(r["intended"] for r in rows(out))
    assert [round(t - got[0], 6) for t in got] == [0.0, 0.2, 0.4, 0.6]  # 400 ms apart, twice as fast


def test_prompts_of_a_block_are_the_same_wherever_the_id_appears():
    import numpy as np

    r = Replay([ReplayItem(0, 6, 1, (3,)), ReplayItem(1, 4, 1, (3, 4))], "x", "mooncake", block_size=4)
    rng = np.random.default_rng(0)
    p0, p1 = r.prompt(0, rng, 500), r.prompt(1, rng, 500)
    assert p0[:4] == p1 and len(p0) == 6 and all(10 <= t < 500 for t in p0)


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "empty"),
        ("not json\n", "neither a store nor JSON lines"),
        ('{"a": 1}\n', "not a store, an OTLP trace file"),
        ('{"timestamp": 0, "input_length": 3}\n', ":1: not a Mooncake record"),
        ('{"timestamp": 0, "input_length": 3, "output_length": 0}\n', ":1: needs timestamp >= 0 and lengths >= 1"),
        ('{"id": "a", "submit": 0, "end": 1, "status": "ok", "events": [[0.5, 1]]}\n', "has no input length"),
    ],
)
def test_files_that_cannot_be_replayed_are_named(tmp_path, content, message):
    f = tmp_path / "w.jsonl"
    f.write_text(content)
    proc = run_cli("bench", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--replay", f, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "--replay" in proc.stderr, proc.stderr


def test_replay_option_errors(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 3, "output_length": 2}\n')
    base = ("bench", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--replay", f)
    proc = run_cli(*base, "--replay-speed", "0", check=False)
    assert proc.returncode == 2 and "--replay-speed" in proc.stderr
    proc = run_cli(*base, "--replay-run", "r1", check=False)
    assert proc.returncode == 2 and "--replay-run selects from a store or a traces file" in proc.stderr
    proc = run_cli("bench", "--base-url", "x", "--model", "m", "--replay", tmp_path / "absent", check=False)
    assert proc.returncode == 2 and "No such file" in proc.stderr
    assert detect(str(f)) == "mooncake"
