"""otel-llm compare: decomposition, stalls, and clock offsets between hosts."""

import json
import time

import pytest
from conftest import run_cli
from support.otlp_helpers import Req, emit, grpc_exporter, provider

from collector.analysis.compare import compare

US = 1e-6


def shifted(r: Req, theta_ms: float) -> Req:
    """The same request as seen by an engine whose clock runs ``theta_ms`` ahead."""
    r.arrival += theta_ms
    r.first_scheduled += theta_ms
    r.first_generated += theta_ms
    r.engine_events = [(t + theta_ms, k) for t, k in r.engine_events]
    r.engine_end += theta_ms
    r.preemptions = [(a + theta_ms, b + theta_ms) for a, b in r.preemptions]
    return r


def fill(make_collector, reqs):
    c = make_collector()
    tp = provider(grpc_exporter(c.receivers[0].port))
    base = time.time_ns()
    for i, r in enumerate(reqs):
        emit(tp.get_tracer("t"), r, base + i * 1_000_000_000)
    tp.shutdown()
    t0 = time.monotonic()
    while c.store.count() < 2 * len(reqs) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    c.stop()
    return c.config.store


def varied(k: int) -> Req:
    """Request k: network in 1+k ms, delivery of the first token 2+k ms."""
    net = 1 + k
    r = Req(f"v{k}", arrival=net, first_scheduled=net + 5, first_generated=net + 20)
    first_client = r.first_generated + 2 + k
    r.client_events = [(first_client, 1), (first_client + 30, 1), (first_client + 60, 1)]
    r.engine_events = [(r.first_generated + 1, 1), (r.first_generated + 31, 1), (r.first_generated + 61, 1)]
    r.engine_end = r.engine_events[-1][0] + 1
    r.client_end = r.client_events[-1][0] + 5
    return r


def test_same_host_decomposition_through_the_cli(make_collector):
    store = fill(make_collector, [varied(k) for k in range(5)])
    out = json.loads(run_cli("compare", "--store", store, "--format", "json").stdout)
    s = out["summary"]
    assert s["requests_paired"] == 5 and s["clock_offset"]["theta_s"] == 0
    assert s["clock_offset"]["low_s"] <= 0 <= s["clock_offset"]["high_s"]
    for r in out["requests"]:
        k = int(r["id"][1:])
        assert r["to_engine"] == pytest.approx((1 + k) / 1000, abs=US)
        assert (r["queue"], r["prefill"]) == pytest.approx((0.005, 0.015), abs=US)
        assert r["delivery"] == pytest.approx((2 + k) / 1000, abs=US)
        assert r["to_engine"] + r["queue"] + r["prefill"] + r["delivery"] == pytest.approx(r["client_ttft"], abs=US)
        assert r["engine_ttft"] <= r["client_ttft"] and r["client_tokens"] == r["engine_tokens"] == 3
    assert s["max_abs_parts_sum_error_s"] < 1e-6
    table = run_cli("compare", "--store", store).stdout
    assert "Client TTFT decomposition" in table and "to_engine" in table


def test_injected_clock_offset_is_bounded_and_corrected(make_collector):
    theta_ms = 2500.0
    store = fill(make_collector, [shifted(varied(k), theta_ms) for k in range(6)])
    from collector.storage.store import RequestStore

    recs = RequestStore(store).records()
    rows, off, _pairs, _ = compare(recs)
    # the engine span can only nest in the client span for offsets in [low, high]; the truth is inside
    assert off.low <= theta_ms / 1000 <= off.high
    assert off.width == pytest.approx(0.002, abs=US)  # min delivery 1 ms after arrival... both edges 1 ms off
    assert off.source.startswith("midpoint")
    for r in rows:
        k = int(r.id[1:])
        assert abs(r.to_engine - (1 + k) / 1000) <= off.width
        assert abs(r.delivery - (2 + k) / 1000) <= off.width
        assert r.to_engine + r.queue + r.prefill + r.delivery == pytest.approx(r.client_ttft, abs=US)
    # an offset can also be given: then it is applied as is
    rows2, off2, _, _ = compare(recs, clock_offset=theta_ms / 1000)
    assert off2.source == "given"
    assert [round(r.to_engine, 6) for r in rows2] == [round((1 + int(r.id[1:])) / 1000, 6) for r in rows2]
    out = json.loads(run_cli("compare", "--store", store, "--format", "json").stdout)
    assert out["summary"]["clock_offset"]["width_s"] == pytest.approx(off.width, abs=US)


def test_stall_classification(make_collector):
    base = dict(
        client_events=[(100, 1), (130, 1), (400, 1)],
        client_end=410,
        engine_events=[(85, 1), (115, 1), (155, 1)],
        engine_end=160,
    )
    delivery = Req("delivery-stall", **base)  # the engine handed token 3 out at 155 ms; the client saw it at 400
    eng = Req(
        "preempted",
        client_events=[(100, 1), (130, 1), (400, 1)],
        client_end=410,
        engine_events=[(85, 1), (115, 1), (390, 1)],
        engine_end=395,
        preemptions=[(120, 380)],
    )
    other = Req(
        "engine-other",
        client_events=[(100, 1), (130, 1), (400, 1)],
        client_end=410,
        engine_events=[(85, 1), (115, 1), (390, 1)],
        engine_end=395,
    )
    smooth = Req("smooth")
    store = fill(make_collector, [delivery, eng, other, smooth])
    out = json.loads(run_cli("compare", "--store", store, "--format", "json").stdout)
    stalls = {r["id"]: r["stall"] for r in out["requests"]}
    assert stalls == {
        "delivery-stall": "delivery",
        "preempted": "engine:preemption",
        "engine-other": "engine:other",
        "smooth": "none",
    }
    assert out["summary"]["stalls"] == {
        "network/client": 0,
        "api_server": 0,
        "delivery": 1,
        "engine:preemption": 1,
        "engine:prefill": 0,
        "engine:rejected-drafts": 0,
        "engine:batch": 0,
        "engine:idle": 0,
        "engine:other": 1,
        "unknown": 0,  # every source here gives each token's time
    }  # no steps in this store: engine:other is not refined


def test_compare_without_pairs_says_so(make_collector):
    store = fill(make_collector, [Req("solo", engine=False)])
    proc = run_cli("compare", "--store", store, check=False)
    assert proc.returncode == 2 and "no request seen at both boundaries" in proc.stderr
    assert "The engine sent nothing: start it with OTEL_LLM_ENABLE=1" in proc.stderr  # the likely cause, named


def test_offset_survives_abandoned_and_failed_requests(make_collector):
    """A known offset between hosts, recovered within the bounds, with a client that gave up early
    (the engine outlives it), a request the engine failed and one whose client span was cut short
    mixed in: those do not bound the offset by their ends, the decomposition of every other request
    stays within the bounds' width of the truth, and the pairs left out are counted."""
    theta_ms = 1500.0
    reqs = [shifted(varied(k), theta_ms) for k in range(6)]
    gave_up = shifted(varied(6), theta_ms)
    gave_up.status = "cancelled"  # the client closed the stream after two tokens, at 135 ms
    gave_up.client_events, gave_up.client_end = gave_up.client_events[:2], gave_up.client_events[1][0] + 5
    failed = shifted(Req("x7", status="error"), theta_ms)
    store = fill(make_collector, [*reqs, gave_up, failed])
    from collector.storage.store import RequestStore

    recs = RequestStore(store).records()
    rows, off, _pairs, _ = compare(recs)
    assert off.low <= theta_ms / 1000 <= off.high and off.width < 0.005
    assert off.pairs_used == 8 and off.excluded == {}
    for r in rows:
        if r.id.startswith("x"):
            continue
        k = int(r.id[1:])
        if k < 6:
            assert abs(r.to_engine - (1 + k) / 1000) <= off.width
            assert r.to_engine > 0 and r.delivery > 0
    out = json.loads(run_cli("compare", "--store", store, "--format", "json").stdout)
    assert out["summary"]["clock_offset"]["pairs_used"] == 8
