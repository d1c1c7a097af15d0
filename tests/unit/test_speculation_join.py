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


def account(internal, drafts, accepted, method="ngram", n=0):
    return sp.make_span(
        f"{n + 99:032x}",
        f"{n + 99:016x}",
        sc.SPAN_ENGINE_SPECULATION,
        start=T0,
        end=T0 + 40_000_000,
        internal_id=internal,
        spec_method=method,
        spec_event_tokens=[1] * len(drafts),
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
