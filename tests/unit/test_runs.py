"""Runs you can tell apart: bench's run id and warm-up mark travel into every derived record, and
analyze / compare select by run, service, time and warm-up; windows read as times."""

import json
import time

import numpy as np
import pytest
from conftest import run_cli
from support.otlp_helpers import Req, emit, grpc_exporter, provider

from otel_llm import semconv as sc


def _req(rid: str, run: str, warmup: bool = False) -> Req:
    return Req(rid, client_attrs={sc.BENCH_RUN_ID: run, sc.BENCH_WARMUP: warmup})


@pytest.fixture
def store(make_collector):
    """Two runs 100 s apart (A: 3 requests + 1 warm-up; B: 2), and one request of no run, from
    another service."""
    c = make_collector()
    port = c.receivers[0].port
    base = time.time_ns() - 10**12  # 1000 s ago
    tp = provider(grpc_exporter(port), service="bench-a")
    for i, r in enumerate([_req("a-w", "A", True), _req("a0", "A"), _req("a1", "A"), _req("a2", "A")]):
        emit(tp.get_tracer("t"), r, base + i * 10**9)
    tp.shutdown()
    tp = provider(grpc_exporter(port), service="bench-b")
    for i, r in enumerate([_req("b0", "B"), _req("b1", "B")]):
        emit(tp.get_tracer("t"), r, base + 100 * 10**9 + i * 10**9)
    tp.shutdown()
    tp = provider(grpc_exporter(port), service="other")
    emit(tp.get_tracer("t"), Req("x0"), base + 200 * 10**9)
    tp.shutdown()
    t0 = time.monotonic()
    while c.store.count() < 14 and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    c.stop()
    return c.config.store, base


def analyze(store, *flags, boundary="client"):
    out = run_cli("analyze", "--store", store, "--boundary", boundary, "--format", "json", *flags).stdout
    return json.loads(out)


def test_records_carry_the_run_and_the_warmup_mark(store):
    from collector.storage.store import RequestStore

    path, _ = store
    recs = {(r.boundary, r.request_id): r for r in RequestStore(path).records()}
    assert recs[("client", "a0")].run_id == "A" and recs[("engine", "a0")].run_id == "A"  # the engine's: its client's
    assert recs[("client", "a-w")].warmup and recs[("engine", "a-w")].warmup
    assert recs[("client", "x0")].run_id is None and not recs[("client", "x0")].warmup


def test_warmup_is_left_out_unless_asked_for(store):
    path, _ = store
    assert analyze(path)["counts"]["requests"] == 6  # 3 + 2 + 1: the warm-up is not counted
    assert analyze(path, "--include-warmup")["counts"]["requests"] == 7
    assert analyze(path, boundary="engine")["counts"]["requests"] == 6  # at the engine boundary too


def test_select_by_run_service_and_time(store):
    path, base = store
    assert analyze(path, "--run", "A")["counts"]["requests"] == 3
    assert analyze(path, "--run", "A", "--run", "B")["counts"]["requests"] == 5
    assert analyze(path, "--service", "bench-b")["counts"]["requests"] == 2
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(base / 1e9 + 50))
    until = f"{base / 1e9 + 150:.3f}"  # Unix seconds work too
    got = analyze(path, "--since", since, "--until", until)
    assert got["counts"]["requests"] == 2 and got["selection"]["since"].startswith(since[:19])
    out = json.loads(run_cli("compare", "--store", path, "--run", "B", "--format", "json").stdout)
    assert out["summary"]["requests_paired"] == 2 and {r["id"] for r in out["requests"]} == {"b0", "b1"}


def test_nothing_selected_is_said(store):
    path, _ = store
    proc = run_cli("analyze", "--store", path, "--run", "nope", check=False)
    assert proc.returncode == 2 and "match the selection" in proc.stderr


def test_windows_relative_to_the_selection_and_as_times(store):
    path, base = store
    rel = analyze(path, "--run", "A", "--window", "0,0.5")  # from run A's first (measured) submit
    first = base / 1e9 + 1  # a0, the first measured request of run A
    assert rel["window"]["start"] == pytest.approx(first, abs=1e-3) and rel["window"]["seconds"] == pytest.approx(0.5)
    assert rel["counts"]["completed"] == 1  # a0 ends 0.18 s after its submit; a1 is submitted 1 s later
    w0 = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(base / 1e9 + 100))
    w1 = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(base / 1e9 + 110))
    iso = analyze(path, "--window", f"{w0}Z,{w1}Z")
    assert iso["counts"]["completed"] == 2  # run B
    table = run_cli("analyze", "--store", path, "--run", "B").stdout
    assert f"{w0[:10]}T" in table and "Z to " in table and "T = " in table  # ISO times, not Unix seconds
    assert "1796" not in table.split("== Window ==")[1].split("\n")[1]


def test_a_warm_up_in_the_batch_costs_the_others_none_of_their_live_metrics():
    """The live metrics leave warm-ups out without losing the pairs of the other requests derived
    with them: the client TTFT parts and the stall verdicts count every paired request that
    compare counts (a warm-up used to drop every pair of its batch)."""
    from support.otlp_helpers import sample_request

    from collector.pipeline import walked_span as sp
    from collector.pipeline.assembly import ReleasedTrace
    from collector.pipeline.derive import derive
    from collector.pipeline.metrics_registry import MetricsRegistry
    from collector.receivers.decode import walk_message

    reqs = [_req("w0", "A", True), _req("w1", "A", True), *(_req(f"r{i}", "A") for i in range(5))]
    spans = walk_message(sample_request(reqs)).spans
    traces: dict[bytes, list] = {}
    for s in spans:
        traces.setdefault(s[sp.TRACE_ID], []).append(s)
    batch, rm = derive([ReleasedTrace(t, ss, "grace") for t, ss in traces.items()])
    assert batch.pairs is not None and len(batch.pairs[0]) == 7 and batch.warmup.sum() == 4
    kept = batch.take(np.flatnonzero(~batch.warmup))
    assert len(kept.pairs[0]) == 5  # renumbered: each pair's client and engine records, both kept
    assert all(kept.request_id[c] == kept.peer_request_id[e] for c, e in zip(*kept.pairs))
    reg = MetricsRegistry()
    reg.record(batch, rm)
    parts = [s.count for labels, s in reg.ttft_part.series.items() if labels[2] == "queue"]
    assert parts == [5]
    ok = reg.requests.series[("client", "tiny", "ok")]
    assert ok == 5


def test_a_boundary_with_no_records_names_the_boundaries_there(tmp_path):
    """analyze on an engine-only traces file (the toy engine's) without --boundary: says which
    boundary it holds, not that a selection nobody gave matched nothing (#46 item 12)."""
    import subprocess
    import sys

    from conftest import ROOT

    traces = tmp_path / "toy.jsonl"
    env = {**__import__("os").environ, "OTEL_LLM_TRACES_FILE": str(traces)}
    subprocess.run([sys.executable, str(ROOT / "examples" / "toy_engine.py")], env=env, check=True, timeout=120,
                   capture_output=True)  # fmt: skip
    proc = run_cli("analyze", "--traces", str(traces), check=False)
    assert proc.returncode == 2 and "--boundary engine" in proc.stderr and "selection" not in proc.stderr
    assert run_cli("analyze", "--traces", str(traces), "--boundary", "engine", "--format", "json").returncode == 0
