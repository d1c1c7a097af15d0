"""A trace holds many requests (#48): an agent's or a chain's calls under one application span,
minutes apart. Assembly releases and derives per request: a later request of a trace already
derived is a new request, not a late retry; a true retry (the same span, or the same request id
at the same boundary) is still counted once; a call in flight at the trace's timeout is not split;
a trace that never ends holds no more than its requests in flight."""

from __future__ import annotations

import numpy as np
import pytest

from collector.pipeline import walked_span as sp
from collector.pipeline.assembly import AssemblyConfig, RecentRequests, TraceAssembler
from collector.pipeline.derive import derive
from collector.pipeline.walked_span import make_span
from otel_llm import semconv as sc

TRACE = "ab" * 16
APP = "a0" * 8  # the application's span every call ran under (never sent: not a request span)
S = 10**9


def call(k: int, t0: float, client=True, server=True, rid=None, trace=TRACE) -> dict[str, list[tuple]]:
    """One call's spans, by who exports them: the engine (llm.request and its queue and prefill
    spans, and the HTTP server span above them) and the client (llm.client.request under APP)."""
    rid = rid or f"cmpl-{k}"
    base = int(t0 * S)
    c, h, e = f"c{k:015x}", f"5{k:015x}", f"e{k:015x}"
    eng_parent = h if server else (c if client else APP)
    out = {
        "engine": [
            make_span(
                trace,
                e,
                sc.SPAN_REQUEST,
                parent=eng_parent,
                start=base + 2_000_000,
                end=base + 50_000_000,
                kind=2,
                request_id=rid,
                offsets=[10_000_000, 20_000_000],
                tokens=[1, 1],
            ),
            make_span(trace, f"9{k:015x}", sc.SPAN_QUEUE, parent=e, start=base + 3_000_000, end=base + 4_000_000),
            make_span(trace, f"8{k:015x}", sc.SPAN_PREFILL, parent=e, start=base + 4_000_000, end=base + 12_000_000),
        ]
    }
    if server:
        out["engine"].append(
            make_span(
                trace,
                h,
                "POST /v1/completions",
                parent=c if client else APP,
                start=base + 1_000_000,
                end=base + 51_000_000,
                kind=2,
                chunk_offsets=[11_000_000, 21_000_000, 50_000_000],
            )
        )
    if client:
        out["client"] = [
            make_span(
                trace,
                c,
                sc.SPAN_CLIENT_REQUEST,
                parent=APP,
                start=base,
                end=base + 52_000_000,
                kind=3,
                request_id=rid,
                offsets=[12_000_000, 22_000_000],
                tokens=[1, 1],
            )
        ]
    return out


def agent_batch(calls: int, gap: float):
    """``calls`` calls ``gap`` s apart in TRACE, and one call alone in a trace of its own, assembled
    as the collector takes them and derived."""
    asm = TraceAssembler(AssemblyConfig(grace_s=1.0, peer_wait_s=8.0, timeout_s=30.0))
    arrivals = []
    for k in range(calls):
        spans = call(k, gap * k)
        arrivals += [(gap * k + 0.06, spans["engine"]), (gap * k + 0.3, spans["client"])]
    one = call(9, 1.0, trace="cd" * 16)
    arrivals.append((1.1, one["engine"] + one["client"]))
    return derive(run(asm, arrivals, 20.0))[0]


def run(asm: TraceAssembler, arrivals: list[tuple[float, list[tuple]]], until: float) -> list:
    """Feed spans at their arrival times, expiring every 0.1 s, then until ``until``."""
    released, t = [], 0.0
    for at, spans in sorted(arrivals, key=lambda a: a[0]):
        while t + 0.1 <= at:
            t += 0.1
            released += asm.expire(t)
        released += asm.add(spans, at)
    while t < until:
        t += 0.1
        released += asm.expire(t)
    return released


def test_the_calls_of_one_trace_are_each_derived_and_paired_by_parentage():
    """Three calls 2.5 s apart under one application span (the issue's first case: 2 of 6 records
    were stored): 6 records, 3 pairs, each call's own TTFT parts, each naming the application span."""
    asm = TraceAssembler(AssemblyConfig(grace_s=1.0, peer_wait_s=8.0, timeout_s=30.0))
    arrivals = []
    for k in range(3):
        spans = call(k, 2.5 * k)
        arrivals += [(2.5 * k + 0.06, spans["engine"]), (2.5 * k + 0.3, spans["client"])]
    released = run(asm, arrivals, 20.0)
    assert asm.counters.spans_late == 0 and len(asm) == 0
    assert [r.reason for r in released] == ["grace"] * 3  # one release per call
    batch, _ = derive(released)
    recs = batch.records()
    assert sorted((r.boundary, r.request_id) for r in recs) == sorted(
        (b, f"cmpl-{k}") for k in range(3) for b in ("client", "server", "engine")
    )
    assert all(r.paired for r in recs if r.boundary != "server")
    assert {(r.request_id, r.peer_request_id) for r in recs if r.boundary == "client"} == {
        (f"cmpl-{k}", f"cmpl-{k}") for k in range(3)
    }
    assert {r.caller_span_id for r in recs} == {APP} and {r.trace_id for r in recs} == {TRACE}
    client = sorted((r for r in recs if r.boundary == "client"), key=lambda r: r.submit_ns)
    assert [round(r.ttft, 3) for r in client] == [0.012] * 3
    assert all(r.queue == pytest.approx(0.001) and r.prefill == pytest.approx(0.008) for r in client)


def test_engine_spans_alone_past_the_trace_timeout_are_all_derived():
    """Nine calls 4.5 s apart, engine spans only (the issue's third case: the calls after
    --trace-timeout were dropped as late): every one is derived."""
    asm = TraceAssembler(AssemblyConfig(grace_s=1.0, peer_wait_s=2.0, timeout_s=30.0))
    arrivals = [(4.5 * k + 0.06, call(k, 4.5 * k, client=False)["engine"]) for k in range(9)]
    released = run(asm, arrivals, 60.0)
    batch, _ = derive(released)
    engine = [r for r in batch.records() if r.boundary == "engine"]
    assert sorted(r.request_id for r in engine) == [f"cmpl-{k}" for k in range(9)]
    assert asm.counters.spans_late == 0 and {r.caller_span_id for r in engine} == {APP}


def test_a_call_in_flight_at_the_timeout_is_held_back_not_split():
    """Calls back to back (no quiet grace period) for longer than --trace-timeout: the release at
    the timeout keeps back the engine spans still waiting for their client, so every call is
    derived paired, none split into two unpaired records."""
    asm = TraceAssembler(AssemblyConfig(grace_s=1.0, peer_wait_s=8.0, timeout_s=3.0))
    arrivals = []
    for k in range(12):
        spans = call(k, 0.5 * k)
        arrivals += [(0.5 * k + 0.06, spans["engine"]), (0.5 * k + 0.9, spans["client"])]  # the client 0.84 s later
    released = run(asm, arrivals, 30.0)
    assert asm.counters.traces_released_timeout >= 1 and asm.counters.spans_held_back > 0
    batch, _ = derive(released)
    recs = batch.records()
    assert len(recs) == 36 and all(r.paired for r in recs if r.boundary != "server")
    assert len({(r.boundary, r.request_id) for r in recs}) == 36


@pytest.mark.parametrize("when", ["early", "late"])
def test_a_retried_export_is_still_counted_once(when):
    """The same spans again (the sender's retry of an export whose answer was lost), while the
    request is in flight or after it was derived and later calls of its trace came: counted once;
    the same request id at the same boundary under another span id too."""
    asm = TraceAssembler(AssemblyConfig(grace_s=1.0, peer_wait_s=8.0, timeout_s=30.0))
    first = call(0, 0.0)
    arrivals = [(0.06, first["engine"]), (0.3, first["client"])]
    arrivals += [
        (0.07 if when == "early" else 9.0, first["engine"]),
        (0.31 if when == "early" else 9.1, first["client"]),
    ]
    for k in range(1, 3):
        spans = call(k, 3.0 * k)
        arrivals += [(3.0 * k + 0.06, spans["engine"]), (3.0 * k + 0.3, spans["client"])]
    again = call(7, 12.0, rid="cmpl-0")["client"]  # another span, the request id of call 0
    arrivals.append((12.0, again))
    released = run(asm, arrivals, 30.0)
    batch, _ = derive(released)
    recs = batch.records()
    assert sorted((r.boundary, r.request_id) for r in recs) == sorted(
        (b, f"cmpl-{k}") for k in range(3) for b in ("client", "server", "engine")
    )
    if when == "early":
        assert asm.counters.spans_duplicate == 5 and asm.counters.spans_late == 1
    else:
        assert asm.counters.spans_late == 6


def test_a_trace_that_never_ends_holds_only_its_requests_in_flight():
    """A trace of 1,000 calls: each is released when complete, whatever the trace does, so the
    spans in flight never exceed one call's; what is remembered of the trace is bounded too."""
    asm = TraceAssembler(AssemblyConfig(grace_s=0.2, peer_wait_s=8.0, timeout_s=30.0))
    most, released = 0, []
    for k in range(1000):
        spans = call(k, 0.5 * k)
        released += asm.expire(0.5 * k)
        asm.add(spans["engine"], 0.5 * k + 0.01, bytes_per_span=1000)
        asm.add(spans["client"], 0.5 * k + 0.05, bytes_per_span=1000)
        most = max(most, asm.bytes)
    released += asm.expire(1000.0)
    assert most <= 5 * 1000 and asm.bytes == 0 and len(asm) == 0
    batch, _ = derive(released)
    assert int(np.sum(batch.paired)) == 2000 and len(batch) == 3000
    small = RecentRequests(10**6, per_trace=500)
    for k in range(1000):
        small.add(b"t" * 16, b"C" + k.to_bytes(8, "big"), 1)
    known = small.get(b"t" * 16)
    assert len(known) <= 500 and b"C" + (999).to_bytes(8, "big") in known  # the newest kept, the oldest forgotten
    assert b"C" + (0).to_bytes(8, "big") not in known


def test_remembering_is_per_request_and_bounded_by_the_limit():
    """--remember-traces counts requests: past limit // 2 requests released since, a request is
    forgotten (its retry reaches derivation again, the store's key still drops it)."""
    asm = TraceAssembler(AssemblyConfig(grace_s=0.5, peer_wait_s=1.0, timeout_s=30.0, remember_released=8))
    first = call(0, 0.0, trace="01" * 16)
    run_at = [(0.1, first["engine"] + first["client"])]
    for k in range(1, 9):
        s = call(k, float(k), trace=f"{k + 1:02x}" * 16)
        run_at.append((float(k) + 0.1, s["engine"] + s["client"]))
    run_at.append((20.0, first["engine"] + first["client"]))
    released = run(asm, run_at, 30.0)
    assert asm.counters.spans_late == 0 and sum(len(r.spans) for r in released) == 10 * 5
    assert {r.trace_id.hex() for r in released} == {f"{k + 1:02x}" * 16 for k in range(9)}
    assert sp.NAMES[released[-1].spans[0][sp.CODE]] in (sc.SPAN_REQUEST, sc.SPAN_CLIENT_REQUEST)


def test_compare_and_analyze_show_one_traces_calls_in_order(tmp_path):
    """What a user reads of an agent's trace: `compare` lists its calls in order with each call's
    TTFT parts and the idle time between calls; `compare --trace` and `analyze --trace` keep that
    trace alone."""
    import json

    from conftest import run_cli

    from collector.storage.store import RequestStore

    batch = agent_batch(3, 2.5)
    store = str(tmp_path / "agent.db")
    s = RequestStore(store)
    s.add(batch)
    s.close()
    out = run_cli("compare", "--store", store).stdout
    section = out[out.index("== Traces of several calls") :]
    assert f"trace {TRACE}: 3 calls over 5.052 s" in section and f"under span {APP}" in section
    assert "cd" * 16 not in section  # one call: not a trace of several
    lines = [ln.split() for ln in section.splitlines() if ln.strip()[:1].isdigit()]
    assert [ln[:4] for ln in lines] == [
        ["1", "cmpl-0", "0.000", "-"],
        ["2", "cmpl-1", "2.500", "2448.0"],  # 2.5 s after the first call began, 52 ms after it ended
        ["3", "cmpl-2", "5.000", "2448.0"],
    ]
    rows = json.loads(run_cli("compare", "--store", store, "--trace", TRACE, "--format", "json").stdout)["requests"]
    assert [(r["id"], r["call"], r["caller_span_id"]) for r in rows] == [(f"cmpl-{k}", k + 1, APP) for k in range(3)]
    assert rows[1]["idle_before"] == pytest.approx(2.448)
    got = json.loads(run_cli("analyze", "--store", store, "--trace", TRACE.upper(), "--format", "json").stdout)
    assert got["counts"]["completed"] == 3
    bad = run_cli("analyze", "--store", store, "--trace", "xyz", check=False)
    assert bad.returncode == 2 and "32 hex digits" in bad.stderr


def test_the_report_lists_a_traces_calls_in_order():
    """The report's section for traces of several calls: each call's row in order, its parts and
    the idle time before it; a trace of one call is not listed."""
    import re

    pytest.importorskip("plotly")
    from collector.analysis.report import render_html
    from collector.analysis.report_data import build_report

    d = build_report(agent_batch(4, 2.0), None, source="test")
    assert [(t.trace_id, len(t.calls)) for t in d.traces] == [(TRACE, 4)]
    page = render_html(d, {})
    section = page[page.index("<h2>Traces of several calls</h2>") :]
    assert f"data-trace='{TRACE}'" in section and "cd" * 16 not in section and f"under span {APP}" in section
    rows = re.findall(r"<tr><td>(\d)</td><td>(cmpl-\d)</td><td>([\d.]+)</td><td>([^<]+)</td>", section)
    assert rows == [("1", "cmpl-0", "0.000", "-")] + [
        (str(k + 1), f"cmpl-{k}", f"{2.0 * k:.3f}", "1948.0") for k in (1, 2, 3)
    ]


@pytest.mark.parametrize("timeout_s", [5.0, 0.0])
def test_a_timeout_shorter_than_the_peer_wait_holds_a_span_back_once(timeout_s):
    """--trace-timeout below --peer-wait (the tests' collectors run 5 s against 10 s): an engine span
    waiting for a client that never comes is held back by one timeout at most, then released
    unpaired, never held again and again (which hung derivation)."""
    asm = TraceAssembler(AssemblyConfig(grace_s=0.2, peer_wait_s=10.0, timeout_s=timeout_s))
    asm.add(call(0, 0.0, server=False)["engine"], 0.0)
    out = asm.expire(timeout_s + 0.1)
    assert asm.counters.spans_held_back == 3
    out += asm.expire(10.05)  # the span's peer wait is over
    assert len(asm) == 0 and sum(len(r.spans) for r in out) == 3
    (r,) = derive(out)[0].records()
    assert r.boundary == "engine" and not r.paired
