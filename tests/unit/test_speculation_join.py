"""The collector's join of engines' speculation accounts to their records
(collector/pipeline/speculation.py), with spans shaped by hand: an account before its record, one
after (unknown, never 0), accounts an attacker shapes badly, the bound, and the method label's
bound. The real engine: tests/integration/test_vllm_speculation.py."""

from __future__ import annotations

import numpy as np
import pytest

from collector.pipeline import walked_span as sp
from collector.pipeline.assembly import ReleasedTrace
from collector.pipeline.derive import derive
from collector.pipeline.metrics_registry import MAX_SPEC_METHODS, MetricsRegistry
from collector.pipeline.speculation import SpeculationIndex, acceptance, split_accounts
from otel_llm import semconv as sc

T0 = 1_700_000_000_000_000_000


def request(n: int, internal: str | None) -> ReleasedTrace:
    """An engine record: 1 + 3 tokens in two events."""
    tid = f"{n + 1:032x}"
    s = sp.make_span(
        tid,
        f"{n + 1:016x}",
        sc.SPAN_REQUEST,
        start=T0,
        end=T0 + 50_000_000,
        request_id=f"r{n}",
        internal_id=internal,
        offsets=[10_000_000, 40_000_000],
        tokens=[1, 3],
    )
    return ReleasedTrace(bytes.fromhex(tid), [s], "grace")


def account(internal, drafts, accepted, method="ngram", n=0, tokens=None):
    return sp.make_span(
        f"{n + 99:032x}",
        f"{n + 99:016x}",
        sc.SPAN_ENGINE_SPECULATION,
        start=T0,
        end=T0 + 40_000_000,
        internal_id=internal,
        spec_method=method,
        spec_event_tokens=tokens or [1] * len(drafts),
        spec_event_drafts=drafts,
        spec_event_accepted=accepted,
    )


def test_an_account_joins_its_record_and_a_late_one_leaves_it_unknown():
    index = SpeculationIndex(limit=10)
    spans, accounts = split_accounts([account("a-1", [-1, 3, 3], [0, 2, 0]), request(5, "x").spans[0]])
    assert [s[sp.CODE] for s in spans] == [sp.ENGINE] and len(accounts) == 1
    index.add(accounts)
    batch, _ = derive([request(0, "a-1"), request(1, "b-1"), request(2, None)])
    index.join(batch)
    assert batch.internal_id == ["a-1", "b-1", None]
    assert batch.draft_tokens.tolist() == [6, -1, -1] and batch.accepted_tokens.tolist() == [2, -1, -1]
    assert batch.verify_steps.tolist() == [2, -1, -1] and batch.spec_method == ["ngram", None, None]
    assert batch.acceptance_rate[0] == pytest.approx(2 / 6) and np.isnan(batch.acceptance_rate[1:]).all()
    assert batch.mean_acceptance_length[0] == pytest.approx(2.0) and np.isnan(batch.mean_acceptance_length[2])
    index.add([account("b-1", [-1, 2], [0, 2])])  # after its record: it waits, the record stays unknown
    assert len(index) == 1 and index.joined == 1


def test_acceptance_is_unknown_without_drafts_never_zero():
    rate, length = acceptance(np.array([0, 4, -1]), np.array([0, 4, -1]), np.array([1, 2, -1]))
    assert np.isnan(rate[0]) and rate[1] == 1.0 and np.isnan(rate[2])
    assert length.tolist()[:2] == [1.0, 3.0] and np.isnan(length[2])


def replaced(s: tuple, slot: int, value) -> tuple:
    return s[:slot] + (value,) + s[slot + 1 :]


def test_accounts_shaped_badly_are_counted_and_kept_out():
    index = SpeculationIndex(limit=10)
    bad = [
        account("a", [3, 3], [1]),  # arrays of other lengths
        account("b", [3], [-2]),  # a negative acceptance
        account("c", [-5], [0]),  # drafts below -1
        account(None, [3], [1]),  # no internal id
        account("d", [3], [1])[: sp.SPEC_EVENT_DRAFTS] + ("x",) + account("d", [3], [1])[sp.SPEC_EVENT_DRAFTS + 1 :],
        account("e", [3], [1])[: sp.SPEC_EVENT_DRAFTS]
        + (sp.INVALID,)
        + account("e", [3], [1])[sp.SPEC_EVENT_DRAFTS + 1 :],
    ]
    index.add(bad)
    assert index.malformed == len(bad) and len(index) == 0


def test_the_index_is_bounded():
    index = SpeculationIndex(limit=2)
    index.add([account(f"q{i}", [3], [1], n=i) for i in range(5)])
    assert len(index) == 2 and index.evicted == 3


def test_the_method_label_is_bounded():
    reg = MetricsRegistry()
    batch, rm = derive([request(i, f"i{i}") for i in range(MAX_SPEC_METHODS + 4)])
    index = SpeculationIndex()
    index.add([account(f"i{i}", [-1, 3], [0, 1], method=f"m{i}", n=i) for i in range(MAX_SPEC_METHODS + 4)])
    index.join(batch)
    reg.record(batch, rm)
    methods = {labels[2] for labels in reg.spec_draft_tokens.series}
    assert len(methods) == MAX_SPEC_METHODS + 1 and "_other" in methods
    assert sum(reg.spec_draft_tokens.series.values()) == 3 * (MAX_SPEC_METHODS + 4)


def test_a_client_keeps_the_servers_own_account_and_nothing_malformed():
    """vLLM's metrics.speculative_decoding on a stream's last chunk becomes the client span's
    llm.speculation.* counts; a server's malformed account becomes nothing, not zeros."""
    from otel_llm.client.client_span import StreamRecorder, speculation_attributes

    good = {
        "mean_acceptance_length": 2.0,
        "draft_acceptance_rate": 0.5,
        "acceptance_histogram": [1, 0, 1],
        "num_spec_steps": 2,
        "num_accepted_draft_tokens": 2,
        "num_draft_tokens": 4,
        "num_spec_tokens": 2,
        "per_step_accepted": [0, 2],
        "per_step_drafted": [2, 2],
    }
    rec = StreamRecorder()
    rec.chunk({"id": "x", "choices": [{"index": 0, "text": "a"}], "usage": {"completion_tokens": 1}}, 1)
    rec.chunk(
        {"id": "x", "choices": [], "usage": {"completion_tokens": 4}, "metrics": {"speculative_decoding": good}}, 2
    )
    a = speculation_attributes(rec.speculation)
    assert (a[sc.SPECULATION_DRAFT_TOKENS], a[sc.SPECULATION_ACCEPTED_TOKENS], a[sc.SPECULATION_VERIFY_STEPS]) == (
        4,
        2,
        2,
    )
    assert a[sc.SPECULATION_STEP_DRAFTS] == [2, 2] and a[sc.SPECULATION_K] == 2
    assert speculation_attributes(None) == {} and speculation_attributes({"num_draft_tokens": 4}) == {}
    assert speculation_attributes({**good, "num_draft_tokens": "4"}) == {}
    assert speculation_attributes({**good, "num_spec_steps": -1}) == {}
    odd = speculation_attributes({**good, "per_step_drafted": [2]})  # arrays that do not line up: counts only
    assert sc.SPECULATION_STEP_DRAFTS not in odd and odd[sc.SPECULATION_DRAFT_TOKENS] == 4
    rec = StreamRecorder()
    rec.chunk({"choices": [], "metrics": "junk"}, 1)
    rec.chunk({"choices": [], "metrics": {"speculative_decoding": [1, 2]}}, 2)
    assert rec.speculation is None


def test_the_largest_gap_names_the_step_that_ended_it():
    """The step that gave the last token of the event ending the largest gap: its drafts and those
    accepted, on the engine record and its client's. The client's largest gap picks the event (not
    the engine's own largest), and an event the front end merged from two steps takes its last
    step; an engine record alone takes its own largest gap; no per-step tokens: unknown."""
    ms, tid = 1_000_000, "ab" * 16
    # the engine's events: 1, 1 (merged: a step of 0 accepted then one of 1), 4 tokens, 2
    e_offs, e_toks = [10 * ms, 30 * ms, 80 * ms, 90 * ms], [1, 1 + 2, 4, 2]
    # the client saw as many events; its largest gap ends on the second (the engine's on the third)
    c_offs = [12 * ms, 95 * ms, 100 * ms, 110 * ms]
    client = sp.make_span(tid, "c1" * 8, sc.SPAN_CLIENT_REQUEST, start=T0 - ms, end=T0 + 120 * ms, kind=3,
                          request_id="cmpl-g", offsets=c_offs, tokens=e_toks)  # fmt: skip
    engine = sp.make_span(tid, "e1" * 8, sc.SPAN_REQUEST, parent="c1" * 8, start=T0, end=T0 + 100 * ms, kind=2,
                          request_id="cmpl-g", internal_id="g-1", offsets=e_offs, tokens=e_toks)  # fmt: skip
    alone = request(7, "h-1")  # events of 1 and 3 tokens: its only gap ends on the second
    steps = sp.make_span("99" * 16, "98" * 8, sc.SPAN_ENGINE_SPECULATION, start=T0, end=T0 + 90 * ms,
                         internal_id="g-1", spec_method="ngram", spec_event_tokens=[1, 1, 2, 4, 2],
                         spec_event_drafts=[-1, 3, 3, 3, 3], spec_event_accepted=[0, 0, 1, 3, 1])  # fmt: skip
    index = SpeculationIndex(limit=10)
    index.add([steps, account("h-1", [-1, 3], [0, 2], n=1, tokens=[1, 3])])
    batch, _ = derive([ReleasedTrace(bytes.fromhex(tid), [client, engine], "grace"), alone])
    index.join(batch)
    got = list(zip(batch.boundary, batch.gap_step_draft_tokens.tolist(), batch.gap_step_accepted_tokens.tolist()))
    assert batch.paired.tolist() == [True, True, False]
    # the merged event's last step, not the 4-token one; the lone record's own gap
    assert got == [("client", 3, 1), ("engine", 3, 1), ("engine", 3, 2)]
    # an account without per-step tokens of the right length: its totals, not the gap's step
    bare = SpeculationIndex(limit=10)
    bare.add([replaced(account("h-1", [-1, 3], [0, 2], n=1), sp.SPEC_EVENT_TOKENS, None)])
    again, _ = derive([request(7, "h-1")])
    bare.join(again)
    assert again.draft_tokens.tolist() == [3] and again.gap_step_draft_tokens.tolist() == [-1]
    # per-step tokens an attacker shaped (a step of 0 or fewer tokens): the totals stand, no gap step
    shaped = SpeculationIndex(limit=10)
    shaped.add([account("h-1", [-1, 3], [0, 2], n=1, tokens=[4, -3])])
    again, _ = derive([request(7, "h-1")])
    shaped.join(again)
    assert again.draft_tokens.tolist() == [3] and again.gap_step_draft_tokens.tolist() == [-1]


def test_compare_reads_the_largest_stall_with_its_steps_acceptance():
    """A verify step twice the median that accepted 2 of 16 drafts fills the engine's gap: compare
    names the stall engine:rejected-drafts and prints it with what its step verified and accepted
    for the request; without the steps the same stall is engine:other, its step's drafts still shown."""
    from collector.analysis.compare import compare, summarize_comparison
    from collector.analysis.compare_format import format_comparison
    from collector.pipeline.steps import StepBatch

    ms, tid = 1_000_000, "cd" * 16
    e_offs, c_offs, toks = [10 * ms, 30 * ms, 250 * ms, 260 * ms], [12 * ms, 32 * ms, 255 * ms, 265 * ms], [1, 2, 1, 4]
    client = sp.make_span(tid, "c2" * 8, sc.SPAN_CLIENT_REQUEST, start=T0 - ms, end=T0 + 270 * ms, kind=3,
                          request_id="cmpl-s", offsets=c_offs, tokens=toks)  # fmt: skip
    engine = sp.make_span(tid, "e2" * 8, sc.SPAN_REQUEST, parent="c2" * 8, start=T0, end=T0 + 262 * ms, kind=2,
                          request_id="cmpl-s", internal_id="s-1", offsets=e_offs, tokens=toks,
                          service="vllm")  # fmt: skip
    steps = sp.make_span("97" * 16, "96" * 8, sc.SPAN_ENGINE_SPECULATION, start=T0, end=T0 + 260 * ms,
                         internal_id="s-1", spec_method="ngram", spec_event_tokens=toks,
                         spec_event_drafts=[-1, 3, 3, 3], spec_event_accepted=[0, 1, 0, 3])  # fmt: skip
    index = SpeculationIndex(limit=10)
    index.add([steps])
    batch, _ = derive([ReleasedTrace(bytes.fromhex(tid), [client, engine], "grace")])
    index.join(batch)
    records = batch.records()
    starts = [t for t in range(0, 300, 10) if not 30 <= t < 250] + [30]
    rows = sorted((T0 + a * ms, T0 + (a + (215 if a == 30 else 9)) * ms) for a in starts)
    n = len(rows)
    long_step = [a for a, _ in rows].index(T0 + 30 * ms)
    run = StepBatch(
        trace_id=["s"] * n, span_id=[str(i) for i in range(n)], service=["vllm"] * n,
        start_ns=np.array([a for a, _ in rows]), end_ns=np.array([b for _, b in rows]), step_index=np.arange(n),
        batch_size=np.full(n, 4), prefill_tokens=np.zeros(n, np.int64), decode_tokens=np.full(n, 4),
        preempted=np.zeros(n, np.int64), kv_usage=np.full(n, 0.5), gpu_time_ns=np.full(n, -1),
        draft_tokens=np.where(np.arange(n) == long_step, 16, 4),
        accepted_tokens=np.where(np.arange(n) == long_step, 2, 3),
    )  # fmt: skip
    for given, cause in ((run, "engine:rejected-drafts"), (None, "engine:other")):
        cmp = compare(records, 0.0, steps=given)
        (row,) = cmp.rows
        assert (row.stall, row.gap_step_draft_tokens, row.gap_step_accepted_tokens) == (cause, 3, 0)
        text = format_comparison(cmp.rows, summarize_comparison(cmp))
        assert f"largest stall: cmpl-s 223.0 ms ({cause}); the step that ended it verified 3 drafts, accepted 0" in text
        assert "(the request's acceptance 0.444)" in text
    # the report: the request's acceptance against its largest gap, coloured by the cause, the step in the hover
    from collector.analysis.report import figures
    from collector.analysis.report_data import build_report

    figs = figures(build_report(batch, run, source="test"))
    (dot,) = figs["fig-acceptance"].data
    assert dot.name == "engine:rejected-drafts" and dot.x == (pytest.approx(4 / 9),)
    assert dot.y == (pytest.approx(223.0),) and "the step that ended it: 3 drafts, 0 accepted" in dot.text[0]
    plain, _ = derive([request(3, None)])  # no speculation: no acceptance figure
    assert "fig-acceptance" not in figures(build_report(plain, None, source="test"))
