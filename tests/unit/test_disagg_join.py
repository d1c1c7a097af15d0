"""Disaggregated prefill/decode (#43): the prefill and decode legs of one client request, in the
client's trace behind a traced proxy, are one request in the collector, joined by trace and by the
peer ids (never by time); a leg whose other leg never came stays a record of its own, saying which
leg it is; both legs with the same request id (vLLM's proxy sends one X-Request-Id to both) are not
one duplicate span; a decode leg answers for its prefill leg's wait for a client span."""

from __future__ import annotations

import pytest

from collector.pipeline import walked_span as sp
from collector.pipeline.assembly import AssemblyConfig, TraceAssembler
from collector.pipeline.derive import derive
from collector.pipeline.walked_span import make_span
from otel_llm import semconv as sc
from tests.unit.test_many_requests_per_trace import run

TRACE = "cd" * 16
MS = 1_000_000


def pd_call(
    k: int,
    t0_ms: int = 0,
    *,
    decode: bool = True,
    client: bool = True,
    peer: str | None = None,
    peer_engine: str = "engine-P",
    trace: str = TRACE,
    same_id: bool = True,
    disk: bool = False,
) -> dict[str, list[tuple]]:
    """One P/D call's spans by sender: the client, the proxy (its server span), the prefill engine
    (its server span, llm.request with role prefill, queue and prefill) and the decode engine (the
    same, role decode, naming the prefill leg's internal id and engine id). Times in ms after t0."""
    b = t0_ms * MS
    c, px, ps, pe, ds, de = (f"{tag}{k:014x}" for tag in ("c1", "a1", "b1", "e1", "b2", "e2"))
    rid = f"cmpl-{k}" if same_id else f"cmpl-p{k}"
    out = {
        "client": [
            make_span(trace, c, sc.SPAN_CLIENT_REQUEST, start=b, end=b + 90 * MS, kind=3, request_id=f"cmpl-{k}",
                      offsets=[62 * MS, 70 * MS, 80 * MS], tokens=[1, 1, 1]),
        ],
        "proxy": [make_span(trace, px, "POST /v1/completions", parent=c, start=b + 1 * MS, end=b + 89 * MS, kind=2)],
        "prefill": [
            make_span(trace, ps, "POST /v1/completions", parent=px, start=b + 2 * MS, end=b + 20 * MS, kind=2,
                      chunk_offsets=[17 * MS]),
            make_span(trace, pe, sc.SPAN_REQUEST, parent=ps, start=b + 3 * MS, end=b + 19 * MS, kind=2,
                      request_id=rid if same_id else f"cmpl-p{k}", internal_id=f"cmpl-{k}-p",
                      offsets=[15 * MS], tokens=[1], pd_role="prefill", pd_connector="NixlConnector",
                      pd_engine_id="engine-P"),
            make_span(trace, f"f1{k:014x}", sc.SPAN_QUEUE, parent=pe, start=b + 4 * MS, end=b + 6 * MS),
            make_span(trace, f"f2{k:014x}", sc.SPAN_PREFILL, parent=pe, start=b + 6 * MS, end=b + 17 * MS),
        ],
    }  # fmt: skip
    if decode:
        out["decode"] = [
            make_span(trace, ds, "POST /v1/completions", parent=px, start=b + 30 * MS, end=b + 88 * MS, kind=2,
                      chunk_offsets=[31 * MS, 39 * MS, 49 * MS]),
            make_span(trace, de, sc.SPAN_REQUEST, parent=ds, start=b + 31 * MS, end=b + 87 * MS, kind=2,
                      request_id=f"cmpl-{k}", internal_id=f"cmpl-{k}-d", offsets=[29 * MS, 37 * MS, 47 * MS],
                      tokens=[1, 1, 1], pd_role="both" if disk else "decode",
                      pd_connector="ExampleConnector" if disk else "NixlConnector", pd_engine_id="engine-D",
                      pd_peer_request_id=None if disk else peer or f"cmpl-{k}-p",
                      pd_peer_engine_id=None if disk else peer_engine),
            make_span(trace, f"f5{k:014x}", sc.SPAN_FRONTEND, parent=de, start=b + 31 * MS, end=b + 32 * MS),
            make_span(trace, f"f3{k:014x}", sc.SPAN_QUEUE, parent=de, start=b + 32 * MS, end=b + 55 * MS),
            make_span(trace, f"f4{k:014x}", sc.SPAN_PREFILL, parent=de, start=b + 55 * MS, end=b + 60 * MS),
        ]  # fmt: skip
    if not client:
        del out["client"]
    return out


def derived(calls: list[dict], until: float = 30.0, **config):
    asm = TraceAssembler(AssemblyConfig(**{"grace_s": 1.0, "peer_wait_s": 8.0, "timeout_s": 60.0, **config}))
    # the senders export in the order their spans end: prefill, then decode and proxy, then the client
    order = ("prefill", "decode", "proxy", "client")
    arrivals = [
        (i * 0.5 + 0.1 * order.index(who), spans) for i, call in enumerate(calls) for who, spans in call.items()
    ]
    released = run(asm, arrivals, until)
    assert len(asm) == 0
    return asm, released, derive(released)[0].records()


def test_both_legs_are_one_request_paired_with_its_client():
    asm, released, recs = derived([pd_call(k, 500 * k) for k in range(4)])
    assert asm.counters.spans_duplicate == 0 and asm.counters.spans_late == 0
    engine = sorted((r for r in recs if r.boundary == "engine"), key=lambda r: r.request_id)
    client = sorted((r for r in recs if r.boundary == "client"), key=lambda r: r.request_id)
    assert len(engine) == len(client) == 4  # not 8 engine records: the prefill legs are joined
    assert all(r.paired for r in engine + client)
    for e, c in zip(engine, client):
        assert e.internal_id.endswith("-d")  # the decode leg, which gave the client its tokens
        assert e.pd_role == c.pd_role == "disaggregated"
        assert e.pd_connector == "NixlConnector" and e.prefill_engine_id == "engine-P"
        assert e.prefill_request_id == e.internal_id[:-2] + "-p"
        assert e.prefill_leg == pytest.approx(0.016) and c.prefill_leg == pytest.approx(0.016)
        assert e.prefill_leg_queue == pytest.approx(0.002) and e.prefill_leg_prefill == pytest.approx(0.011)
        assert e.prefill_leg_tokens == 1
        assert e.queue == pytest.approx(0.023) and e.prefill == pytest.approx(0.005)  # the decode engine's own
        assert e.output_tokens == c.output_tokens == 3
        assert c.ttft == pytest.approx(0.062)  # at the client's boundary
    # released by grace once the decode leg and the client came, not after the peer wait
    assert {r.reason for r in released} == {"grace"}
    # the server records: one per engine record (the decode server's), none for the prefill leg
    assert sum(r.boundary == "server" for r in recs) == 4


def test_a_prefill_leg_without_its_decode_leg_stays_a_record_that_says_so():
    """The decode engine was down: the client got the proxy's error; the prefill leg is its own
    record, role prefill, not joined to anything."""
    calls = [pd_call(0, decode=False), pd_call(1, 500)]
    _, _, recs = derived(calls)
    engine = {r.internal_id: r for r in recs if r.boundary == "engine"}
    assert set(engine) == {"cmpl-0-p", "cmpl-1-d"}
    assert engine["cmpl-0-p"].pd_role == "prefill" and engine["cmpl-0-p"].prefill_leg is None
    assert engine["cmpl-1-d"].pd_role == "disaggregated"


def test_legs_join_by_the_peer_ids_never_by_time():
    """A decode leg naming another prefill request, or another prefill engine, joins nothing."""
    _, _, recs = derived([pd_call(0, peer="cmpl-other-p"), pd_call(1, 500, peer_engine="engine-X")])
    engine = [r for r in recs if r.boundary == "engine"]
    assert len(engine) == 4
    assert sorted(r.pd_role for r in engine) == ["decode", "decode", "prefill", "prefill"]
    assert all(r.prefill_leg is None and r.prefill_leg_tokens is None for r in engine)


def test_legs_in_different_traces_are_not_joined():
    """A proxy that did not carry the trace context: each leg is in a trace of its own."""
    a = pd_call(0, client=False)
    b = pd_call(0, client=False, trace="ef" * 16)
    calls = [{"prefill": a["prefill"]}, {"decode": b["decode"]}]
    _, _, recs = derived(calls)
    assert sorted(r.pd_role for r in recs if r.boundary == "engine") == ["decode", "prefill"]


def test_without_a_client_span_the_decode_leg_pairs_nothing_and_is_counted_once():
    _, _, recs = derived([pd_call(k, 500 * k, client=False) for k in range(3)])
    engine = [r for r in recs if r.boundary == "engine"]
    assert len(engine) == 3 and {r.pd_role for r in engine} == {"disaggregated"}
    assert not any(r.paired for r in engine)


def test_a_decode_leg_after_its_prefill_leg_was_released_is_kept_not_taken_for_a_retry():
    """Both legs carry one request id (vLLM's proxy sends one X-Request-Id to both). A decode leg
    that comes after its prefill leg was released (a peer wait shorter than the decode) is a leg of
    its own, not the prefill leg again: derived, never dropped as late."""
    call = pd_call(0, client=False)
    asm = TraceAssembler(AssemblyConfig(grace_s=1.0, peer_wait_s=2.0, timeout_s=60.0))
    released = asm.add(call["prefill"], 0.1)
    for t in range(1, 50):
        released += asm.expire(t * 0.1)
    assert len(released) == 1  # the prefill leg, alone
    released += asm.add(call["decode"] + call["proxy"], 5.0)
    for t in range(51, 150):
        released += asm.expire(t * 0.1)
    assert asm.counters.spans_late == 0
    recs = derive(released)[0].records()
    assert sorted(r.pd_role for r in recs if r.boundary == "engine") == ["decode", "prefill"]


def test_the_client_ttft_of_a_joined_request_is_not_called_network():
    """Client send -> the decode server's read holds the proxy and the whole prefill leg: no
    network_in there; to_engine holds it, and the parts still sum to the client's TTFT."""
    _, _, recs = derived([pd_call(0)])
    (c,) = [r for r in recs if r.boundary == "client"]
    assert c.network_in is None and c.to_engine == pytest.approx(0.031)
    parts = (c.to_engine, c.front_end, c.queue, c.prefill, c.api_out, c.network_out)
    assert None not in parts and sum(parts) == pytest.approx(c.ttft, abs=1e-9)
    # to_engine split at the prefill engine: the call -> its arrival (the proxy in it), its leg, the hop
    assert (c.to_prefill, c.prefill_leg, c.pd_hop) == pytest.approx((0.003, 0.016, 0.012))
    assert c.to_prefill + c.prefill_leg + c.pd_hop == pytest.approx(c.to_engine, abs=1e-12)
    (e,) = [r for r in recs if r.boundary == "engine"]
    assert e.prefill_arrival_ns - e.submit_ns == -28 * MS  # the prefill engine's arrival, on its clock
    assert e.to_prefill is None and e.pd_hop is None  # the client's parts: on the client record


def test_compare_shows_a_disaggregated_requests_to_engine_in_its_three_parts():
    """What a user reads: compare's parts, their sum, their shares, and its text table naming them."""
    from collector.analysis.compare import compare, summarize_comparison
    from collector.analysis.compare_format import format_comparison

    _, _, recs = derived([pd_call(k, 500 * k) for k in range(3)])
    cmp = compare(recs)
    assert len(cmp.rows) == 3
    for row in cmp.rows:
        assert row.pd_role == "disaggregated"
        assert list(row.parts)[:4] == ["to_prefill", "prefill_leg", "pd_hop", "front_end"]
        assert sum(row.parts.values()) == pytest.approx(row.client_ttft, abs=1e-9)
    summary = summarize_comparison(cmp)
    assert {"to_prefill", "prefill_leg", "pd_hop"} <= set(summary.ttft_share)
    assert "network_in" not in summary.ttft_share and "to_engine" not in summary.ttft_share
    assert summary.ttft_share["prefill_leg"] == pytest.approx(0.016 / 0.062)
    text = format_comparison(cmp.rows, summary)
    assert all(f"\n{n} " in text for n in ("to_prefill", "prefill_leg", "pd_hop"))


def test_each_engine_says_its_leg_from_the_requests_kv_transfer_params():
    """What vLLM's proxy sends each leg (and what the prefill engine answers), read as the front
    end's arrival hook reads it."""
    from engine_hooks.vllm.disagg import leg_attributes

    connector = {sc.PD_CONNECTOR: "NixlConnector", sc.PD_ENGINE_ID: "engine-D"}
    to_prefill = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
    returned = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-P"}
    returned.update(remote_request_id="cmpl-1-0-abc", remote_block_ids=[1, 2], remote_host="127.0.0.1")
    assert leg_attributes(to_prefill, connector) == {**connector, sc.PD_ROLE: "prefill"}
    assert leg_attributes(returned, connector) == {
        **connector,
        sc.PD_ROLE: "decode",
        sc.PD_PEER_REQUEST_ID: "cmpl-1-0-abc",
        sc.PD_PEER_ENGINE_ID: "engine-P",
    }
    assert leg_attributes(None, connector)[sc.PD_ROLE] == "both"  # sent to one engine whole
    assert leg_attributes(["not", "a", "mapping"], connector)[sc.PD_ROLE] == "both"


def test_a_prefill_leg_whose_request_failed_is_not_a_success():
    """The decode server was down: the client got the proxy's 502; its record pairs with the
    prefill leg, which takes the client's status, never ok."""
    call = pd_call(0, decode=False)
    c = list(call["client"][0])
    c[sp.STATUS] = "error"
    c[sp.OFFSETS] = c[sp.TOKENS] = None
    call["client"] = [tuple(c)]
    _, _, recs = derived([call, pd_call(1, 500)])
    by = {(r.boundary, r.pd_role): r for r in recs}
    assert by[("client", "prefill")].status == "error" and by[("engine", "prefill")].status == "error"
    assert by[("engine", "disaggregated")].status == "ok"


def test_a_prefill_leg_whose_span_comes_last_still_joins():
    """The client's and the decode leg's spans came first; the prefill server's exporter is slow
    (a busy host): the group waits for the leg the decode leg names, within the peer wait."""
    call = pd_call(0)
    asm = TraceAssembler(AssemblyConfig(grace_s=0.5, peer_wait_s=8.0, timeout_s=60.0))
    released = asm.add(call["decode"] + call["proxy"], 0.1) + asm.add(call["client"], 0.2)
    for t in range(3, 30):  # 2.9 s: six grace periods
        released += asm.expire(t * 0.1)
    assert released == []
    released += asm.add(call["prefill"], 3.0)
    for t in range(31, 60):
        released += asm.expire(t * 0.1)
    recs = derive(released)[0].records()
    assert [r.pd_role for r in recs if r.boundary == "engine"] == ["disaggregated"]


def test_a_connector_that_names_no_peer_joins_by_the_proxy_span_both_legs_are_under():
    """The disk connector: the decode leg says both and names no prefill leg; the two legs under one
    proxy span are one request, released by the grace (not after the peer wait)."""
    calls = [pd_call(k, 500 * k, disk=True) for k in range(3)]
    _, released, recs = derived(calls)
    assert {r.reason for r in released} == {"grace"}
    engine = [r for r in recs if r.boundary == "engine"]
    client = {r.peer_request_id: r for r in recs if r.boundary == "client"}  # three calls in one trace
    assert len(engine) == 3 and all(r.pd_role == "disaggregated" and r.internal_id.endswith("-d") for r in engine)
    for e in engine:
        c = client[e.request_id]
        assert e.prefill_request_id == e.internal_id[:-2] + "-p" and e.prefill_leg == pytest.approx(0.016)
        assert (c.to_prefill, c.prefill_leg, c.pd_hop) == pytest.approx((0.003, 0.016, 0.012))


def test_a_leg_that_says_both_without_a_prefill_leg_beside_it_is_its_own_request():
    """An engine with a KV connector that served a request whole, and a prefill leg under another
    proxy span of the same trace: neither joins the other."""
    a = pd_call(0, disk=True)
    b = pd_call(1, 200, disk=True, decode=False, client=False)
    a["prefill"] = []  # a's decode leg served whole: no prefill leg under its proxy span
    a["proxy"] = a["proxy"] + b["prefill"] + b["proxy"]
    _, _, recs = derived([a], peer_wait_s=1.0)
    roles = sorted(r.pd_role for r in recs if r.boundary == "engine")
    assert roles == ["both", "prefill"]


def test_a_decode_leg_that_comes_after_its_client_gave_up_still_joins():
    """A client that cancels early ends its span before the decode engine has even aborted the
    leg: the trace waits for the decode leg its prefill leg announces (up to the peer wait), not
    just the grace after the client, and the request stays one record."""
    call = pd_call(0)
    asm = TraceAssembler(AssemblyConfig(grace_s=0.5, peer_wait_s=8.0, timeout_s=60.0))
    arrivals = [(0.0, call["prefill"]), (0.1, call["proxy"]), (0.2, call["client"]), (2.5, call["decode"])]
    released = run(asm, arrivals, 30.0)
    recs = derive(released)[0].records()
    assert sorted(r.pd_role for r in recs if r.boundary == "engine") == ["disaggregated"]
    assert asm.counters.spans_late == 0
