"""A traced process that forks (vLLM starts its engine core with fork on some platforms; any
multiprocessing worker pool can): the child's spans are exported by a pipeline that works there,
none of the parent's is exported twice, and the parent goes on exporting its own."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from otel_llm import semconv as sc
from otel_llm.otlp.span_records import read_trace_file

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")


def _requests(hooks, ids):
    @hooks.arrival(request_id=lambda res, rid: rid, input_tokens=lambda res, rid: 4)
    def add(rid):
        return rid

    @hooks.token_out(outputs=lambda res, rid: [(rid, 2)])
    def emit(rid):
        return rid

    @hooks.finish(request_id=lambda res, rid: rid, status=lambda res, rid: "ok")
    def finish(rid):
        return rid

    return add, emit, finish


def _child(ids):
    """In the forked child: the parent's EngineHooks (and its default pipeline) traces these."""
    import engine_hooks_fork_state as st

    add, emit, finish = st.funcs
    for rid in ids:
        add(rid)
        emit(rid)
        finish(rid)
    # no explicit flush: the pipeline's thread, or multiprocessing's finalizer at the child's exit


def test_spans_from_a_forked_child_are_exported_once(tmp_path, monkeypatch):
    import sys
    import types

    from engine_hooks import EngineHooks
    from engine_hooks.pipeline import default_pipeline

    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv("OTEL_LLM_TRACES_FILE", str(path))
    monkeypatch.setenv("OTEL_LLM_SCHEDULE_DELAY", "20")
    hooks = EngineHooks(engine="forktest", service_name="forktest")
    add, emit, finish = _requests(hooks, None)
    st = types.ModuleType("engine_hooks_fork_state")
    st.funcs = (add, emit, finish)
    monkeypatch.setitem(sys.modules, "engine_hooks_fork_state", st)
    add("parent-done")
    emit("parent-done")
    finish("parent-done")
    add("parent-open")  # in flight while the process forks: the parent's, not the child's
    p = default_pipeline(engine="forktest", model=None, service_name="forktest")
    assert p._thread is not None and p._thread.is_alive()
    ctx = multiprocessing.get_context("fork")
    kids = [ctx.Process(target=_child, args=([f"child{k}-{i}" for i in range(5)],)) for k in range(2)]
    for k in kids:
        k.start()
    for k in kids:
        k.join(30)
        assert k.exitcode == 0
    emit("parent-open")
    finish("parent-open")
    p.shutdown()
    spans = [s for s in read_trace_file(path) if s.name == sc.SPAN_REQUEST]
    ids = sorted(s.attributes[sc.REQUEST_ID] for s in spans)
    want = sorted(["parent-done", "parent-open"] + [f"child{k}-{i}" for k in range(2) for i in range(5)])
    assert ids == want  # every request once: none lost in a child, none of the parent's twice
    assert all(s.attributes[sc.STATUS] == "ok" and s.attributes[sc.OUTPUT_TOKENS] == 2 for s in spans)
