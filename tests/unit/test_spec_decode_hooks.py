"""The engine core's speculative-decoding accounts (engine_hooks.vllm.spec_decode and
engine_hooks.spans.speculation) on stand-in scheduler objects shaped as vLLM 0.32's: what a step
verified, counted as vLLM's scheduler counts it, including a stopped request whose sampled tokens
vLLM cuts in place and a request aborted while drafting. The real engine:
tests/integration/test_vllm_speculation.py."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from engine_hooks import EngineHooks, TracingPipeline
from engine_hooks.api import hooked
from engine_hooks.spans.speculation import SpeculationBook
from engine_hooks.vllm.core import instrument_scheduler_class
from engine_hooks.vllm.spec_decode import step_speculation
from otel_llm import semconv as sc
from otel_llm.otlp.export import FileSpanExporter
from otel_llm.otlp.span_records import read_trace_file


def so(spec, scheduled, invalid=None):
    """A SchedulerOutput: drafts per request, tokens scheduled per request."""
    return NS(
        scheduled_spec_decode_tokens=spec,
        num_invalid_spec_tokens=invalid,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        preempted_req_ids=(),
    )


def mro(sampled: dict):
    """A ModelRunnerOutput: the tokens each request sampled."""
    ids = list(sampled)
    return NS(req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[list(sampled[r]) for r in ids])


def scheduler_class():
    class Scheduler:  # vLLM's: update_from_output cuts a stopped request's sampled tokens in place
        num_sampled_tokens_per_step = 1

        def __init__(self, speculative=True, stop_at=None):
            config = NS(method="ngram") if speculative else None
            self.vllm_config = NS(speculative_config=config)
            self.num_spec_tokens = 3
            self.stop_at = stop_at or {}  # request id -> tokens it may still take
            self.kv_cache_manager, self.waiting, self.running = NS(usage=0.1), [], []

        def schedule(self):
            return "plan"

        def update_from_output(self, so, mro):
            outs = []
            for rid, i in mro.req_id_to_index.items():
                toks = mro.sampled_token_ids[i]
                if rid in self.stop_at:
                    del toks[self.stop_at[rid] :]  # as vLLM's _update_request_with_output does
                outs.append(NS(request_id=rid, new_token_ids=toks, finish_reason=0 if rid in self.stop_at else None))
            return {0: NS(outputs=outs)}

        def finish_requests(self, request_ids, status):
            return [NS(request_id=r) for r in request_ids]

        def _preempt_request(self, request, timestamp):
            return None

        def shutdown(self):
            return None

    return Scheduler


def test_a_step_counts_drafts_and_acceptances_as_vllm_does():
    assert step_speculation(None, NS(), so({}, {"a": 1}), mro({"a": [5]})) is None  # no drafts: nothing said
    # a: 3 drafts, 2 accepted (3 sampled); b: 2 drafts, one invalidated by a grammar, none accepted;
    # c: decoding without drafts; d: drafts, but aborted while the step ran (not in the output)
    out = so({"a": [1, 2, 3], "b": [4, 5], "d": [6]}, {"a": 4, "b": 3, "c": 1, "d": 2}, invalid={"b": 1})
    sampled = mro({"a": [7, 8, 9], "b": [1], "c": [2]})
    assert step_speculation(None, NS(num_sampled_tokens_per_step=1), out, sampled) == (4, 2)


@pytest.mark.parametrize("detail", ["phases", "steps"])
def test_each_request_is_booked_step_by_step_and_stopped_drafts_count(tmp_path, detail):
    """Steps: a and b prefill (one token each), then verify drafts; b stops with 4 tokens sampled
    of which vLLM keeps 1 (its accepted drafts are still 3, as vLLM counts them), a is aborted
    while drafting. Verify steps are decode steps."""
    from engine_hooks.vllm.spec_decode import _output_scan

    _output_scan()  # vLLM imported, as in its engine core: not on the pipeline's thread, past the exit timeout
    path = tmp_path / "spans.jsonl"
    pipeline = TracingPipeline(FileSpanExporter(str(path)), service_name="core", interval_s=60, detail=detail)
    cls = scheduler_class()
    assert instrument_scheduler_class(cls, EngineHooks(pipeline))
    plain = cls(speculative=False)
    assert "update_from_output" not in vars(plain) and "finish_requests" not in vars(plain)  # no drafts: untouched
    s = cls(stop_at={})
    assert hooked(vars(s)["finish_requests"]) and hooked(vars(s)["update_from_output"])  # on the instance
    s.schedule()
    s.update_from_output(so({}, {"a": 40, "b": 30}), mro({"a": [1], "b": [2]}))
    s.schedule()
    s.update_from_output(so({"a": [1, 2, 3], "b": [4, 5, 6]}, {"a": 4, "b": 4}), mro({"a": [3, 4], "b": [5]}))
    s.stop_at = {"b": 1}
    s.schedule()
    s.update_from_output(so({"a": [1, 2, 3], "b": [1, 2, 3]}, {"a": 4, "b": 4}), mro({"a": [6], "b": [7, 8, 9, 1]}))
    s.finish_requests(["a"], "aborted")
    pipeline.shutdown()
    spans = read_trace_file(path)
    accounts = {
        x.attributes[sc.REQUEST_INTERNAL_ID]: x.attributes for x in spans if x.name == sc.SPAN_ENGINE_SPECULATION
    }
    a, b = accounts["a"], accounts["b"]
    assert (list(a[sc.SPECULATION_EVENT_TOKENS]), list(a[sc.SPECULATION_EVENT_DRAFTS])) == ([1, 2, 1], [-1, 3, 3])
    assert list(a[sc.SPECULATION_EVENT_ACCEPTED]) == [0, 1, 0] and a[sc.SPECULATION_ACCEPTED_TOKENS] == 1
    assert (a[sc.SPECULATION_DRAFT_TOKENS], a[sc.SPECULATION_VERIFY_STEPS]) == (6, 2)
    assert (list(b[sc.SPECULATION_EVENT_TOKENS]), list(b[sc.SPECULATION_EVENT_ACCEPTED])) == ([1, 1, 1], [0, 0, 3])
    assert (a[sc.SPECULATION_METHOD], a[sc.SPECULATION_K]) == ("ngram", 3)
    assert sc.SPECULATION_INCOMPLETE not in a and sc.SPECULATION_INCOMPLETE not in b
    steps = [x.attributes for x in spans if x.name == sc.SPAN_STEP]
    if detail == "phases":
        assert not steps
        return
    assert [(x.get(sc.STEP_DRAFT_TOKENS), x.get(sc.STEP_ACCEPTED_TOKENS)) for x in steps] == [
        (None, None),
        (6, 1),
        (6, 3),
    ]
    assert [(x[sc.STEP_PREFILL_TOKENS], x[sc.STEP_DECODE_TOKENS]) for x in steps] == [(70, 0), (0, 8), (0, 8)]


def test_the_book_is_bounded_and_shutdown_marks_what_is_open():
    book = SpeculationBook(max_in_flight=2)
    book.steps(10, [("a", 1, -1, 0, False), ("b", 1, -1, 0, False)], "ngram", 3)
    book.steps(20, [("c", 1, -1, 0, False)], "ngram", 3)  # a leaves, incomplete
    assert book.evicted == 1 and [r.request_id for r in book.take()] == ["a"]
    book.ended("b")
    book.ended(["unknown"])
    book.close_all()
    done = book.take()
    assert [(r.request_id, r.incomplete) for r in done] == [("b", False), ("c", True)]
    assert len(book) == 0 and done[1].start_ns == done[1].end_ns == 20
