"""A real traced vLLM server loaded by the third-party clients people load servers with, each
request of theirs joined to our server and engine records by the request id the client sent:
tokens equal, every boundary inside the one around it (client TTFT >= server TTFT >= engine
TTFT; server received <= engine arrival <= queued <= scheduled <= first token <= finish), at a
rate that does not queue and at one that does."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from conftest import run_cli, start_collector, start_vllm_server
from support.third_party_clients import guidellm_run, vllm_bench_serve

from engine_hooks.tiny_model import stop_cpu_server

pytestmark = pytest.mark.slow

N = 100  # vllm bench serve: 12.5 s at 8 requests/s; all at once, they still queue


def _check_request(i: int, client_ttft: float, client_tokens: int, server, engine) -> None:
    """Every invariant the three records of one request can decide (raises AssertionError)."""
    assert server is not None and engine is not None, "a boundary is missing"
    assert (server.violations, engine.violations) == (None, None)  # collector.pipeline.invariants found none
    assert client_tokens == server.output_tokens == engine.output_tokens
    assert client_ttft >= server.ttft >= engine.ttft > 0
    for part in ("front_end", "queue", "prefill"):
        assert getattr(engine, part) is not None and getattr(engine, part) >= 0, part
    first_token_ns = engine.submit_ns + round(engine.ttft * 1e9)
    assert server.submit_ns <= engine.submit_ns  # received before the engine's arrival
    assert engine.submit_ns <= engine.first_scheduled_ns <= engine.first_generated_ns <= first_token_ns
    assert first_token_ns <= engine.end_ns <= server.end_ns
    for r in (engine, server):  # every token event inside [submit, end]
        offs = np.asarray(r.event_offsets_ns)
        assert offs.min() >= 0 and offs.max() <= r.end_ns - r.submit_ns


@pytest.fixture(scope="module")
def traced(tiny_model, tmp_path_factory):
    """One collector and one traced vLLM server sending to it, shared by the module's tests (a
    server takes about 25 s to start): each test asks for its own request ids and prompts."""
    c, otlp = start_collector(str(tmp_path_factory.mktemp("third-party") / "store.db"), grace_s=0.5)
    otlp = {**otlp, "OTEL_LLM_ENABLE": "1", "OTEL_LLM_SCHEDULE_DELAY": "100"}
    otlp.pop("OTEL_TRACES_EXPORTER")
    try:
        server, base_url = start_vllm_server(tiny_model, otlp)
    except BaseException:
        c.stop()
        raise
    try:
        yield c, base_url
    finally:
        stop_cpu_server(server)
        c.stop()


def _stored(c, n: int) -> dict:
    """The store's records by (boundary, request id), once ``n`` are in (60 s at most)."""
    deadline = time.monotonic() + 60
    while c.store.count() < n and time.monotonic() < deadline:
        time.sleep(0.2)
    return {(r.boundary, r.request_id): r for r in c.store.records()}


def _summary(name: str, diffs: list[float]) -> None:
    d = np.array(diffs) * 1e3
    print(f"{name}: client - server TTFT over {len(d)} requests: median {np.median(d):.2f} ms, max {d.max():.2f} ms")


@pytest.mark.parametrize("rate", ["8", "inf"], ids=["no-queue", "queues"])
def test_vllm_bench_serve_joins_every_request(traced, tiny_model, tmp_path, rate):
    c, base_url = traced
    before = c.store.count()
    prefix, seed = ("X", "1") if rate == "8" else ("Y", "2")  # its own ids and prompts (no prefix cache hit)
    result = vllm_bench_serve(
        base_url,
        tiny_model,
        tmp_path,
        *("--dataset-name", "random", "--random-input-len", "48", "--random-output-len", "32"),
        *("--ignore-eos", "--num-prompts", str(N), "--request-rate", rate, "--seed", seed),
        *("--request-id-prefix", prefix),
    )
    records = _stored(c, before + 2 * N)
    failures, diffs = [], []
    for i, (ttft, tokens) in enumerate(zip(result["ttfts"], result["output_lens"])):
        rid = f"cmpl-{prefix}{i}-0"  # vLLM's id for x-request-id X<i>, prompt 0
        server_rec, engine_rec = records.get(("server", rid)), records.get(("engine", rid))
        try:
            _check_request(i, ttft, tokens, server_rec, engine_rec)
            diffs.append(ttft - server_rec.ttft)
        except AssertionError as exc:
            failures.append(f"{rid}: {exc}")
    _summary(f"vllm bench serve, rate {rate}", diffs)
    assert failures == [], f"{len(failures)} of {N}: {failures[:5]}"
    if rate == "inf":  # every request at once: they wait (in front of the HTTP app more than in the scheduler)
        assert np.median(result["ttfts"]) > 0.05
    _compare_with_the_tools_results(c.config.store, tmp_path, result, prefix)


def _compare_with_the_tools_results(store: str, tmp_path, result: dict, prefix: str) -> None:
    """Bring your own load generator: compare takes the client boundary from the tool's own
    per-request results, joined by the request id it sent (the prefix found in the store), and
    splits each request's TTFT, as the tool measured it, into the parts exactly."""
    import json

    (path,) = tmp_path.glob("vllm-bench-*.json")
    out = run_cli("compare", "--store", store, "--client-results", path, "--format", "json")
    assert f"{N} of {N} requests of vllm bench serve" in out.stderr and f"request id {prefix}<i>" in out.stderr
    cmp = json.loads(out.stdout)
    rows = {r["id"]: r for r in cmp["requests"]}
    assert cmp["summary"]["requests_paired"] == N == len(rows)
    assert abs(cmp["summary"]["clock_offset"]["theta_s"]) < 1e-3  # one host: the tool's monotonic clock
    for i, ttft in enumerate(result["ttfts"]):
        r = rows[f"{prefix}{i}"]
        assert abs(r["client_ttft"] - ttft) < 1e-6  # the tool's own TTFT, in the parts below
        parts = [r[p] for p in ("network_in", "api_in", "front_end", "queue", "prefill", "api_out", "network_out")]
        assert None not in parts and r["client_send"] is None  # the tool does not say when it began writing
        assert abs(sum(parts) - ttft) < 1e-6
    print("network_in p50 (vllm bench serve: its client library's time before the send included):", end=" ")
    print(f"{np.median([r['network_in'] for r in rows.values()]) * 1e3:.2f} ms")
    # a prefix that is not in the store, and a file that is not the tool's: said plainly
    bad = run_cli("compare", "--store", store, "--client-results", path, "--client-id-prefix", "nope-", check=False)
    assert bad.returncode == 2 and f"none of the {N} requests" in bad.stderr
    not_theirs = tmp_path / "not-vllm.json"
    not_theirs.write_text('{"ttfts": []}')
    bad = run_cli("compare", "--store", store, "--client-results", not_theirs, check=False)
    assert bad.returncode == 2 and "--save-detailed" in bad.stderr


@pytest.mark.parametrize("rate", [8.0, float("inf")], ids=["no-queue", "queues"])
def test_guidellm_joins_every_request(traced, tiny_model, tmp_path, rate):
    """guidellm sends no request id: each of its requests is joined by the response id vLLM
    returned to it (``cmpl-<id>``, the engine's ``cmpl-<id>-0``)."""
    import random

    n = 100
    # 48-word prompts in the tiny model's vocabulary (w8..w499: one token each), not the other test's
    rnd = random.Random(1 if rate == 8.0 else 2)
    prompts = [" ".join(f"w{rnd.randrange(8, 500)}" for _ in range(48)) for _ in range(n)]
    c, base_url = traced
    before = c.store.count()
    report = guidellm_run(base_url, tiny_model, tmp_path, prompts, output_tokens=32, rate=rate)
    done = report["benchmarks"][0]["requests"]
    # guidellm's own scheduler now and then leaves a request of its last ones incomplete (twice in
    # CI, never reproduced alone): every request it completed is checked below, and it must
    # complete nearly all and err on none
    left = {k: [(r.get("info") or {}).get("error") for r in done.get(k) or []] for k in ("errored", "incomplete")}
    assert len(done["successful"]) >= n - 2 and not left["errored"], f"guidellm's own run failed: {left}"
    records = _stored(c, before + 2 * n)
    failures, diffs = [], []
    for r in done["successful"]:
        rid = r["response_id"] + "-0"
        t = r["info"]["timings"]
        ttft = t["first_token_iteration"] - t["request_start"]
        assert abs(ttft - r["time_to_first_token_ms"] / 1e3) < 1e-4  # guidellm's own TTFT
        server_rec, engine_rec = records.get(("server", rid)), records.get(("engine", rid))
        try:
            _check_request(0, ttft, r["output_metrics"]["text_tokens"], server_rec, engine_rec)
            diffs.append(ttft - server_rec.ttft)
        except AssertionError as exc:
            failures.append(f"{rid}: {exc}")
    _summary(f"guidellm, rate {rate}", diffs)
    assert failures == [], f"{len(failures)} of {n}: {failures[:5]}"
    (path,) = [p for p in tmp_path.glob("guidellm-*.json")]
    _compare_takes_guidellms_results(c.config.store, path, report)


def _compare_takes_guidellms_results(store: str, path, report: dict) -> None:
    import json

    reqs = report["benchmarks"][0]["requests"]
    done = reqs["successful"]
    out = run_cli(
        "compare", "--store", store, "--client-results", path, "--client-results-format", "guidellm", "--format", "json"
    )
    said = re.search(r"(\d+) of (\d+) requests of guidellm", out.stderr)
    in_file = sum(len(reqs.get(k) or []) for k in ("successful", "errored", "incomplete"))
    assert said and int(said.group(1)) >= len(done) and int(said.group(2)) == in_file, out.stderr
    rows = {r["id"]: r for r in json.loads(out.stdout)["requests"]}
    for r in done:
        row = rows[r["request_id"]]
        assert abs(row["client_ttft"] - r["time_to_first_token_ms"] / 1e3) < 1e-4
        parts = [row[p] for p in ("network_in", "api_in", "front_end", "queue", "prefill", "api_out", "network_out")]
        assert None not in parts and abs(sum(parts) - row["client_ttft"]) < 1e-6
    print(f"network_in p50 (guidellm): {np.median([r['network_in'] for r in rows.values()]) * 1e3:.2f} ms")
    # vLLM's results read as guidellm's: said plainly
    bad = run_cli(
        "compare", "--store", store, "--client-results", path, "--client-results-format", "vllm-bench", check=False
    )
    assert bad.returncode == 2 and "--save-detailed" in bad.stderr
