"""A GenAI client span whose trace context did not reach the server (the openai SDK's instrumentation
puts no traceparent on the request) pairs with the engine's records by its response id
(collector/pipeline/assembly.py, derive.py): whichever of the two traces comes first, within the
peer wait, never by time; shaped by hand at the wire level and fed to the assembler on a clock the
test drives."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.otlp_helpers import body, span

from collector.analysis.compare import compare
from collector.pipeline.assembly import AssemblyConfig, TraceAssembler
from collector.pipeline.derive import derive
from collector.pipeline.metrics_registry import MetricsRegistry
from collector.receivers.decode import decode_payload
from otel_llm import semconv as sc

T0 = 1_750_000_000_000_000_000
MS = 1_000_000
GRACE, PEER = 0.5, 5.0
APP_TRACE, ENGINE_TRACE = 0xC1, 0xE1


def engine_spans(rid: str = "chatcmpl-7", trace: int = ENGINE_TRACE, parent: int = 0, sid: int = 0x10) -> list:
    """What a traced vLLM server sends for one call: its HTTP server span (a root: no traceparent
    came) and the engine's request span under it, tokens at 40, 70, ... ms."""
    chunks = {sc.HTTP_CHUNK_OFFSETS: [40 * MS + i * 30 * MS for i in range(6)] + [293 * MS]}
    server = span(trace, sid, "POST /v1/chat/completions", T0 + 2 * MS, T0 + 296 * MS, chunks, parent=parent, kind=2)
    engine = span(
        trace,
        sid + 1,
        sc.SPAN_REQUEST,
        T0 + 5 * MS,
        T0 + 290 * MS,
        {sc.REQUEST_ID: rid, sc.TOKEN_EVENT_OFFSETS: [35 * MS + i * 30 * MS for i in range(6)],
         sc.TOKEN_EVENT_TOKENS: [1] * 6},
        parent=sid,
        kind=2,
    )  # fmt: skip
    queue = span(trace, sid + 2, sc.SPAN_QUEUE, T0 + 8 * MS, T0 + 10 * MS, {}, parent=sid + 1, kind=1)
    prefill = span(trace, sid + 3, sc.SPAN_PREFILL, T0 + 10 * MS, T0 + 40 * MS, {}, parent=sid + 1, kind=1)
    return decode_payload(body(server, engine, queue, prefill, service="vllm")).spans


def client_spans(rid: str = "chatcmpl-7", trace: int = APP_TRACE, sid: int = 0x21, output: int | None = 6) -> list:
    """The application's span and, under it, the instrumentation's span of one streamed chat call
    (2.4b0: no time to first chunk; ``output`` None: no usage was sent)."""
    attrs = {sc.OPERATION_NAME: "chat", sc.REQUEST_MODEL: "tiny", sc.REQUEST_STREAM: True, sc.RESPONSE_ID: rid}
    if output is not None:
        attrs |= {sc.INPUT_TOKENS: 12, sc.OUTPUT_TOKENS: output}
    app = span(trace, 0x20, "chain.run", T0 - 10 * MS, T0 + 400 * MS, {}, kind=1)
    call = span(trace, sid, "chat tiny", T0, T0 + 300 * MS, attrs, parent=0x20, kind=3)
    return decode_payload(body(app, call, service="chain")).spans


def assembler() -> TraceAssembler:
    return TraceAssembler(AssemblyConfig(grace_s=GRACE, peer_wait_s=PEER, timeout_s=60.0))


def derived(asm: TraceAssembler, at: float) -> list:
    return derive(asm.expire(at))[0].records()


def by_boundary(recs) -> dict:
    return {r.boundary: r for r in recs}


def assert_paired_by_id(recs) -> None:
    got = by_boundary(recs)
    c, e, s = got["client"], got["engine"], got["server"]
    assert c.paired and e.paired and (c.paired_by, e.paired_by) == ("id", "id")
    assert c.peer_request_id == e.request_id == "chatcmpl-7" and e.peer_request_id == c.request_id
    assert c.trace_id == f"{APP_TRACE:032x}" and e.trace_id == s.trace_id == f"{ENGINE_TRACE:032x}"
    assert c.caller_span_id == e.caller_span_id == s.caller_span_id == f"{0x20:016x}"  # the application's span
    assert c.e2e == pytest.approx(0.3) and c.ttft is None  # no first-chunk time: unknown
    assert c.queue == e.queue and c.prefill == e.prefill and c.prefill is not None  # the engine's parts, the client's
    assert c.network_in == pytest.approx(0.002)  # the call's start -> the server read the request


def test_the_engine_first_then_the_call_pairs_by_response_id():
    asm = assembler()
    asm.add(engine_spans(), 0.0)
    assert derived(asm, GRACE + 0.1) == []  # the engine waits for its caller, as it does with a traceparent
    asm.add(client_spans(), 2.0)
    recs = derived(asm, 2.0 + GRACE + 0.1)
    assert sorted(r.boundary for r in recs) == ["client", "engine", "server"]
    assert_paired_by_id(recs)
    assert asm.counters.spans_paired_by_id == 1
    asm.expire(100.0)  # the application's span, alone, is released: no record
    assert len(asm) == 0 and not asm._engine_by_id and not asm._client_by_id


def test_the_call_first_waits_for_its_engine_and_pairs_by_response_id():
    asm = assembler()
    asm.add(client_spans(), 0.0)
    assert derived(asm, GRACE + 0.1) == []  # it waits the peer wait for the engine, not the grace
    asm.add(engine_spans(), 3.0)
    recs = derived(asm, 3.0 + GRACE + 0.1)
    assert_paired_by_id(recs)
    assert derived(asm, 100.0) == [] and len(asm) == 0


def test_a_call_whose_engine_never_comes_is_derived_alone_after_the_peer_wait():
    asm = assembler()
    asm.add(client_spans(), 0.0)
    assert derived(asm, PEER - 0.1) == []
    (c,) = derived(asm, PEER + 0.1)
    assert c.boundary == "client" and not c.paired and c.paired_by is None


def test_past_the_peer_wait_the_two_are_unpaired_records_never_joined_by_time():
    asm = assembler()
    asm.add(engine_spans(), 0.0)
    first = derived(asm, PEER + 0.1)
    assert sorted(r.boundary for r in first) == ["engine", "server"] and not any(r.paired for r in first)
    asm.add(client_spans(), PEER + 1.0)
    (c,) = derived(asm, 2 * PEER + 2.0)
    assert not c.paired and c.peer_request_id is None and asm.counters.spans_paired_by_id == 0


def test_a_retried_export_of_a_call_taken_in_by_id_is_late_not_a_second_record():
    asm = assembler()
    asm.add(engine_spans(), 0.0)
    asm.add(client_spans(), 1.0)
    assert len(derived(asm, 1.0 + GRACE + 0.1)) == 3
    asm.add(client_spans(), 2.0)  # the SDK's exporter retried the batch
    assert derived(asm, 100.0) == []
    assert asm.counters.spans_late == 1


def test_with_the_trace_context_at_the_server_it_is_paired_by_trace():
    asm = assembler()
    asm.add(engine_spans(trace=APP_TRACE, parent=0x21, sid=0x30), 0.0)  # the server span under the call
    asm.add(client_spans(), 1.0)
    got = by_boundary(derived(asm, 1.0 + GRACE + 0.1))
    assert got["client"].paired_by == got["engine"].paired_by == "trace"
    assert asm.counters.spans_paired_by_id == 0


def test_calls_pair_with_their_own_engine_whatever_the_order():
    """Two calls in one application trace; their engines' traces come in the other order, one
    before the calls and one after: each call pairs with the engine of its response id."""
    asm = assembler()
    asm.add(engine_spans("chatcmpl-b", trace=0xE2, sid=0x40), 0.0)
    a = client_spans("chatcmpl-a", sid=0x21)
    b = [s for s in client_spans("chatcmpl-b", sid=0x22) if s[1] == (0x22).to_bytes(8, "big")]
    asm.add(a + b, 1.0)
    asm.add(engine_spans("chatcmpl-a", trace=0xE3, sid=0x50), 2.0)
    recs = derived(asm, 2.0 + GRACE + 0.1)
    pairs = {(r.request_id, r.peer_request_id, r.trace_id[-2:]) for r in recs if r.boundary != "server"}
    assert pairs == {
        ("chatcmpl-a", "chatcmpl-a", "c1"),
        ("chatcmpl-a", "chatcmpl-a", "e3"),
        ("chatcmpl-b", "chatcmpl-b", "c1"),
        ("chatcmpl-b", "chatcmpl-b", "e2"),
    }
    assert all(r.paired_by == "id" for r in recs if r.boundary != "server")
    assert asm.counters.spans_paired_by_id == 2


def test_compare_pairs_an_id_paired_request_across_its_two_traces():
    asm = assembler()
    asm.add(engine_spans(), 0.0)
    asm.add(client_spans(), 1.0)
    recs = derived(asm, 1.0 + GRACE + 0.1)
    cmp = compare(recs)
    assert len(cmp.pairs) == 1 and not cmp.alone
    (row,) = cmp.rows
    assert row.id == "chatcmpl-7" and row.client_e2e == pytest.approx(0.3) and row.client_ttft is None
    assert row.queue is not None and row.prefill is not None  # the engine's parts of the call


def test_records_of_two_collectors_pair_by_id_when_merged():
    """The client's trace went to one collector and the engine's to another (each trace where its
    id led): each derived its boundary unpaired; compare over both stores' records pairs them by the
    id, the engine's parts known, the parts that need both records' times unknown."""
    one, two = assembler(), assembler()
    one.add(client_spans(), 0.0)
    two.add(engine_spans(), 0.0)
    recs = derived(one, 100.0) + derived(two, 100.0)
    assert not any(r.paired for r in recs)
    cmp = compare(recs)
    assert len(cmp.pairs) == 1 and cmp.alone == []
    (row,) = cmp.rows
    (e,) = [r for r in recs if r.boundary == "engine"]
    assert row.paired_by == "id" and row.queue == e.queue and row.prefill == e.prefill
    assert row.network_in is None and row.to_engine is None and row.client_e2e == pytest.approx(0.3)
    assert cmp.pairs[0][0].peer_request_id == "chatcmpl-7"


def test_an_id_two_unpaired_clients_share_pairs_with_neither():
    one, two = assembler(), assembler()
    one.add(client_spans() + client_spans(trace=0xC2), 0.0)
    two.add(engine_spans(), 0.0)
    recs = derived(one, 100.0) + derived(two, 100.0)
    assert sum(r.boundary == "client" for r in recs) == 2
    assert compare(recs).pairs == []


def test_a_stream_without_usage_has_its_token_count_unknown_everywhere(tmp_path):
    """2.4b0 gets no usage from a stream without stream_options.include_usage: the client record's
    count is unknown (NULL in the store), never 0; token throughput leaves it out and says so; a
    TPOT bound is not met by it; the engine's count stays known."""
    from collector.storage.store import RequestStore
    from otel_llm.metrics.slo import SLO
    from otel_llm.metrics.summary import summarize

    asm = assembler()
    asm.add(engine_spans(), 0.0)
    asm.add(client_spans(output=None), 1.0)
    batch, rm = derive(asm.expire(1.0 + GRACE + 0.1))
    got = by_boundary(batch.records())
    reg = MetricsRegistry()
    reg.record(batch, rm)
    tokens = {labels[0]: v for labels, v in reg.output_tokens.series.items()}
    assert tokens["engine"] == 6 and tokens.get("client", 0) == 0  # the unknown count adds nothing
    pairs = {labels[2] for labels, _ in reg.ttft_part.series.items() if labels[0] == "client"}
    assert {"queue", "prefill"} <= pairs  # the id-paired call's parts, as a trace-paired one's
    assert got["client"].output_tokens is None and not got["client"].estimated_tokens
    assert got["engine"].output_tokens == 6 and got["client"].tokens_unread is None
    store = RequestStore(str(tmp_path / "s.db"))
    store.add(batch)
    (c,) = store.batch("client").records()
    assert c.output_tokens is None
    raw = store._db.execute("SELECT output_tokens FROM requests WHERE boundary = 'client'").fetchone()
    assert raw == (None,)
    store.close()
    client = batch.take(np.flatnonzero(np.array(batch.boundary) == "client"))
    s = summarize(client.timelines(), slo=SLO(tpot=1.0))
    assert s.counts.tokens_unknown == 1 and s.counts.tpot_undefined == 0
    assert s.output_tokens_in_window == 0 and s.goodput.good == 0  # not a pass of the TPOT bound
    assert summarize(client.timelines(), slo=SLO(e2e=1.0)).goodput.good == 1


def test_selecting_the_applications_trace_keeps_its_calls_paired_by_id():
    """compare --trace <the application's trace>: the calls' engine and server records are in
    traces of their own, yet they are that trace's requests."""
    from otel_llm.metrics.selection import Selection

    asm = assembler()
    asm.add(engine_spans(), 0.0)
    asm.add(engine_spans("chatcmpl-other", trace=0xE9, sid=0x60), 0.0)
    asm.add(client_spans(), 1.0)
    batch, _ = derive(asm.expire(100.0))
    kept = batch.selected(Selection(traces=(f"{APP_TRACE:032x}",)))
    assert sorted((r.boundary, r.request_id) for r in kept.records()) == [
        ("client", "chatcmpl-7"),
        ("engine", "chatcmpl-7"),
        ("server", "chatcmpl-7"),
    ]
    assert len(compare(kept.records()).pairs) == 1


def test_a_call_first_whose_engine_comes_in_its_own_trace_is_released_after_the_grace_not_the_wait():
    """The trace context reached the server, the call's span came first: once the engine's span
    is in, the group is complete and goes after the grace period, paired by trace."""
    asm = assembler()
    asm.add(client_spans(), 0.0)
    asm.add(engine_spans(trace=APP_TRACE, parent=0x21, sid=0x30), 1.0)
    got = by_boundary(derived(asm, 1.0 + GRACE + 0.1))
    assert got["client"].paired_by == got["engine"].paired_by == "trace"


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 20), st.floats(0, 20), st.booleans(), st.booleans()), min_size=1, max_size=4),
    st.lists(st.floats(0, 25), max_size=6),
    st.sampled_from([60.0, 2.0]),  # --trace-timeout: longer, or shorter than the peer wait
)
def test_any_order_and_retries_give_each_call_one_record_per_boundary_paired_only_with_its_own(calls, ticks, timeout):
    """Calls whose client and engine spans come at any times (some past the peer wait), some
    exported twice, with expiries in between: each call gives one record at each boundary, a pair
    is only ever a call with its own engine, and nothing is left in flight."""
    arrivals = []
    for k, (at_client, at_engine, retry, one_trace) in enumerate(calls):
        rid, sid = f"chatcmpl-{k}", 0x100 + 0x10 * k
        c = [s for s in client_spans(rid, trace=APP_TRACE if one_trace else 0xA00 + k, sid=0x21 + k) if s[2]]
        arrivals.append((at_client, c))
        if retry:
            arrivals.append((at_client + 1.0, c))
        arrivals.append((at_engine, engine_spans(rid, trace=0xE00 + k, sid=sid)))
    arrivals += [(t, None) for t in ticks]
    asm, recs = TraceAssembler(AssemblyConfig(grace_s=GRACE, peer_wait_s=PEER, timeout_s=timeout)), []
    for at, spans in sorted(arrivals, key=lambda a: a[0]):
        if spans is None:
            recs += derived(asm, at)
        else:
            asm.add(spans, at)
    recs += derived(asm, 1000.0)
    assert len(asm) == 0 and not asm._engine_by_id and not asm._client_by_id
    for b in ("client", "server", "engine"):
        assert sorted(r.request_id for r in recs if r.boundary == b) == sorted(
            f"chatcmpl-{k}" for k in range(len(calls))
        )
    for r in recs:
        if r.boundary != "server":
            assert r.paired == (r.peer_request_id is not None)
            assert r.peer_request_id in (None, r.request_id)
            assert r.paired or ticks  # nothing released before the end: every call found its engine


def test_a_call_waiting_for_its_engine_is_held_past_a_timeout_not_split_from_it():
    """--trace-timeout shorter than the peer wait: the call's span (first, waiting for its engine's
    by id) is kept back at the timeout release, as an engine span waiting for its caller is, and
    pairs when the engine's comes, by trace or by id."""
    for trace, parent in ((APP_TRACE, 0x21), (ENGINE_TRACE, 0)):
        asm = TraceAssembler(AssemblyConfig(grace_s=GRACE, peer_wait_s=PEER, timeout_s=2.0))
        asm.add(client_spans(), 0.0)
        assert derived(asm, 2.5) == []  # the timeout released the application's span alone
        assert asm.counters.spans_held_back == 1
        asm.add(engine_spans(trace=trace, parent=parent, sid=0x30), 3.0)
        got = by_boundary(derived(asm, 3.0 + GRACE + 0.1))
        assert got["client"].paired and got["client"].paired_by == ("trace" if trace == APP_TRACE else "id")
        assert derived(asm, 100.0) == [] and len(asm) == 0


def test_an_id_two_engine_traces_share_joins_nothing():
    """A client that sets X-Request-Id to one value for every call makes vLLM give each the same
    response id: the id says nothing of which call is which, so no call joins an engine by it."""
    for order in ("engines first", "calls first"):
        asm, recs = assembler(), []
        engines = engine_spans(trace=0xE1, sid=0x10) + engine_spans(trace=0xE2, sid=0x40)
        calls = client_spans(trace=0xC1) + client_spans(trace=0xC2)
        for spans in (engines, calls) if order == "engines first" else (calls, engines):
            asm.add(spans, 1.0)
        recs = derived(asm, 100.0)
        assert not any(r.paired for r in recs), order
        assert sorted(r.boundary for r in recs) == ["client", "client", "engine", "engine", "server", "server"]
        assert asm.counters.spans_paired_by_id == 0 and not asm._engine_by_id and not asm._client_by_id


def choice_engines(rid: str, trace: int, sid: int, parent: int = 0) -> list:
    """A call with two choices (n = 2) as the hooks record it: one server span, an engine request
    span per choice (llm.request.choice 0 and 1), under a parent the collector may not have."""
    server = span(trace, sid, "POST /v1/chat/completions", T0 + 2 * MS, T0 + 296 * MS,
                  {sc.HTTP_CHUNK_OFFSETS: [40 * MS, 293 * MS]}, parent=parent, kind=2)  # fmt: skip
    out = [server]
    for k in (0, 1):
        out.append(
            span(
                trace,
                sid + 1 + k,
                sc.SPAN_REQUEST,
                T0 + 5 * MS,
                T0 + 290 * MS,
                {
                    sc.REQUEST_ID: rid,
                    sc.REQUEST_CHOICE: k,
                    sc.TOKEN_EVENT_OFFSETS: [35 * MS, 65 * MS],
                    sc.TOKEN_EVENT_TOKENS: [1, 1],
                },
                parent=sid,
                kind=2,
            )
        )
    return decode_payload(body(*out, service="vllm")).spans


@pytest.mark.parametrize("how", ["trace", "id"])
def test_a_call_of_two_choices_pairs_with_its_first_choice(how):
    """The review found n = 2 calls never paired: one call span, an engine record per choice
    (<id>#0, <id>#1). The call pairs with its choice 0, by trace (its context reached the server
    through an httpx span the collector never got) or by id."""
    asm = assembler()
    trace, parent = (APP_TRACE, 0x77) if how == "trace" else (ENGINE_TRACE, 0)
    asm.add(choice_engines("chatcmpl-9", trace, 0x50, parent), 0.0)
    asm.add(client_spans("chatcmpl-9"), 1.0)
    recs = derived(asm, PEER + 0.1)  # two engine spans with a caller, one call span: the peer wait
    (c,) = [r for r in recs if r.boundary == "client"]
    assert c.paired and c.paired_by == how and c.peer_request_id == "chatcmpl-9#0"
    assert sorted((r.request_id, r.paired) for r in recs if r.boundary == "engine") == [
        ("chatcmpl-9#0", True),
        ("chatcmpl-9#1", False),
    ]
