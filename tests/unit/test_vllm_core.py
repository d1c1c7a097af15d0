"""What the vLLM adapter hooks in the engine core at each detail level, and the statistics it
leaves on there: the scheduler's events, without the per-step SchedulerStats, where they were
turned on only for the hooks (engine_hooks.vllm.core), on stand-in scheduler classes."""

from __future__ import annotations

import pytest

from engine_hooks import EngineHooks, TracingPipeline
from engine_hooks.api import hooked
from engine_hooks.vllm import _own_tracing_asked
from engine_hooks.vllm.core import events_only_stats, instrument_scheduler_class


def scheduler_class():
    class Scheduler:  # the methods the adapter hooks, as vLLM's Scheduler names them
        def schedule(self):
            return "plan"

        def update_from_output(self, so, out):
            return {}

        def _preempt_request(self, request, timestamp):
            return None

        def make_stats(self, *a, **k):
            return "stats"

        def shutdown(self):
            return None

    return Scheduler


@pytest.mark.parametrize(
    "detail, hooked_methods",
    [
        ("request", set()),
        ("phases", {"_preempt_request"}),
        ("steps", {"schedule", "update_from_output", "_preempt_request"}),
    ],
)
def test_the_engine_core_hooks_what_its_detail_level_sends(detail, hooked_methods):
    cls = scheduler_class()
    hooks = EngineHooks(TracingPipeline(None, detail=detail))
    assert instrument_scheduler_class(cls, hooks)
    methods = {"schedule", "update_from_output", "_preempt_request"}
    assert {m for m in methods if hooked(getattr(cls, m))} == hooked_methods
    assert hooked(cls.shutdown)  # flushes what it has, at every level
    assert not instrument_scheduler_class(cls, hooks)  # once
    assert cls().make_stats() == "stats"  # statistics as vLLM makes them: not asked otherwise


def test_statistics_on_only_for_the_events_make_no_per_step_stats(monkeypatch):
    cls = scheduler_class()
    monkeypatch.setenv("OTEL_LLM_STATS_FOR_TRACING", "1")
    instrument_scheduler_class(cls, EngineHooks(TracingPipeline(None, detail="phases")))
    assert cls().make_stats() is None and cls().make_stats("spec", perf_stats=1) is None
    assert not events_only_stats(cls)  # once
    assert cls.make_stats.__wrapped__(cls()) == "stats"  # vLLM's own, kept beside it


def test_vllms_own_tracing_asked_for_keeps_its_statistics():
    """instrument() leaves vLLM's per-step statistics alone where the caller turned vLLM's own
    tracing on (it reads them), however it was asked for."""

    class Obs:
        otlp_traces_endpoint = "127.0.0.1:4317"

    class Config:
        observability_config = Obs()

    assert _own_tracing_asked({"otlp_traces_endpoint": "127.0.0.1:4317"})
    assert _own_tracing_asked({"kwargs": {"otlp_traces_endpoint": "x"}})
    assert _own_tracing_asked({"vllm_config": Config()})
    assert not _own_tracing_asked({"model": "m", "kwargs": {"otlp_traces_endpoint": None}})
