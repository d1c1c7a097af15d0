"""OTEL_LLM_DETAIL (request | phases | steps) on the generic hook API (examples/toy_engine.py):
which spans an engine emits at each level, the default, a bad value, what the collector derives
from each, and the recompute tokens on each preemption. The same levels on real vLLM, under fork
and spawn, are in tests/integration/test_vllm_hooks.py."""

from __future__ import annotations

import logging
import sys

import pytest
from conftest import ROOT

from collector.analysis.offline import read_trace_file as derive_trace_file
from engine_hooks import TracingPipeline
from otel_llm import environment
from otel_llm import semconv as sc
from otel_llm.otlp.export import FileSpanExporter
from otel_llm.otlp.span_records import read_trace_file

sys.path.insert(0, str(ROOT / "examples"))
import toy_engine

PHASES = {sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE, sc.SPAN_STREAM, sc.SPAN_PREEMPTION}


def run_toy(path, detail: str | None):
    """Eight requests through the toy engine with a KV budget that forces preemptions, traced at
    ``detail`` into the OTLP JSON-lines file ``path``; (the engine's results, the preemptions)."""
    pipeline = TracingPipeline(FileSpanExporter(str(path)), service_name="toy", interval_s=60, detail=detail)
    toy_engine.hooks.use(pipeline)
    eng = toy_engine.ToyEngine(kv_capacity=250, max_batch=6, step_time_s=0)
    preempted = []
    orig = eng.preempt
    usage = lambda: sum(r.kv_tokens for r in eng.running) / eng.kv_capacity
    eng.preempt = lambda r: (preempted.append((r.id, r.computed, usage())), orig(r))
    for i in range(8):
        eng.add_request(toy_engine.Request(f"r{i}", prompt_len=30 + 5 * i, max_tokens=24))
    done = eng.run()
    pipeline.shutdown()
    return done, preempted


@pytest.mark.parametrize("detail", ["request", "phases", "steps"])
def test_each_level_emits_its_spans_and_the_collector_derives_what_they_hold(tmp_path, detail):
    path = tmp_path / "spans.jsonl"
    done, preempted = run_toy(path, detail)
    assert len(done) == 8 and preempted, "the KV budget should force preemptions"
    spans = read_trace_file(path)
    names = {s.name for s in spans}
    roots = {s.attributes[sc.REQUEST_ID]: s for s in spans if s.name == sc.SPAN_REQUEST}
    assert set(roots) == set(done)
    for rid, r in roots.items():  # at every level: the request with its token events
        assert sum(r.attributes[sc.TOKEN_EVENT_TOKENS]) == len(done[rid][1]) == 24
    expect = {"request": {sc.SPAN_REQUEST}, "phases": {sc.SPAN_REQUEST} | PHASES}.get(
        detail, {sc.SPAN_REQUEST, sc.SPAN_STEPS, sc.SPAN_STEP} | PHASES
    )
    assert names == expect
    records, steps = derive_trace_file(str(path))
    assert len(records) == 8 and set(records.boundary) == {"engine"}
    assert (records.output_tokens == 24).all()
    known = ~(records.queue != records.queue)  # not NaN
    assert known.all() if detail != "request" else not known.any()  # the phases need their spans
    assert len(steps) == (0 if detail != "steps" else sum(1 for s in spans if s.name == sc.SPAN_STEP))
    if detail != "request":  # each preemption says what the engine had when it preempted: the tokens
        # whose KV it dropped (a recompute computes them again) and how full its KV cache was
        got = sorted(
            (s.attributes[sc.PREEMPTION_RECOMPUTE_TOKENS], s.attributes[sc.PREEMPTION_KV_USAGE])
            for s in spans
            if s.name == sc.SPAN_PREEMPTION
        )
        assert sorted((n, kv) for _, n, kv in preempted) == got
        assert all(kv > 0.9 for _, kv in got)  # it preempts when its budget is exceeded


def test_the_default_is_phases_and_a_bad_value_says_so(monkeypatch, caplog):
    monkeypatch.delenv(environment.DETAIL, raising=False)
    assert environment.detail_level() == "phases"
    assert TracingPipeline(None).detail == "phases"
    monkeypatch.setenv(environment.DETAIL, " Steps ")
    assert TracingPipeline(None).detail == "steps"
    monkeypatch.setenv(environment.DETAIL, "everything")
    with caplog.at_level(logging.WARNING, logger="otel_llm"):
        assert TracingPipeline(None).detail == "phases"
    assert "OTEL_LLM_DETAIL" in caplog.text and "request, phases, steps" in caplog.text
    with pytest.raises(ValueError, match="detail must be one of"):
        TracingPipeline(None, detail="all")
