"""The hook events are declared once (engine_hooks.hot_path.hook_events): the builders, the tracker's
handlers, the span process's reader and the tuples the C accelerator packs all follow that one
declaration, field by field."""

from __future__ import annotations

import inspect
import time

import pytest
from conftest import c_or_python

from engine_hooks.api import EngineHooks
from engine_hooks.hot_path import hook_events as events
from engine_hooks.pipeline import TracingPipeline
from engine_hooks.span_process.parent import CallRecorder
from engine_hooks.spans.tracker import RequestTracker


def test_every_kind_is_declared_once_with_distinct_fields():
    kinds = [e.kind for e in events.EVENTS]
    assert sorted(kinds) == list(range(len(kinds))) and len(set(e.name for e in events.EVENTS)) == len(kinds)
    for e in events.EVENTS:
        assert len(set(e.fields)) == len(e.fields) and len(e.defaults) <= len(e.fields), e.name


@pytest.mark.parametrize("event", events.EVENTS, ids=lambda e: e.name)
def test_a_builder_makes_the_declared_tuple(event):
    """Each builder takes the fields by name, in order, and puts each where index() says."""
    build = events.BUILDERS[event.kind]
    assert build is getattr(events, event.name)
    assert list(inspect.signature(build).parameters) == list(event.fields)
    values = {f: object() for f in event.fields}
    ev = build(**values)
    assert len(ev) == 1 + len(event.fields) and ev[0] == event.kind
    assert all(ev[event.index(f)] is v for f, v in values.items())
    required = len(event.fields) - len(event.defaults)
    short = build(*[values[f] for f in event.fields[:required]])
    assert short[1 + required :] == event.defaults


@pytest.mark.parametrize("event", events.EVENTS, ids=lambda e: e.name)
def test_the_tracker_reads_each_kind_by_its_field_names(event):
    """The tracker's handler of each kind names the declared fields, in order, with the same
    defaults: a field added to the declaration and not to its reader fails here."""
    handler = getattr(RequestTracker, f"_on_{event.name}")
    params = list(inspect.signature(handler).parameters.values())[1:]  # self
    assert [p.name for p in params] == list(event.fields)
    defaults = tuple(p.default for p in params if p.default is not inspect.Parameter.empty)
    assert defaults == event.defaults


def test_the_span_process_reads_a_raw_event_by_name():
    raw = events.BY_KIND[events.RAW]
    params = list(inspect.signature(CallRecorder._translate_raw).parameters)[2:]  # self, items
    assert params == list(raw.fields)
    assert events.BY_KIND[events.STEP].index("gpu_handle") == events.STEP_GPU


def test_a_tracker_fed_built_events_gets_the_request_they_describe():
    """Every kind built by its builder and fed to a tracker: the record says what the fields said
    (an unknown kind is counted, never taken for another)."""
    t = RequestTracker()
    now = time.monotonic_ns()
    expanded = []
    t.feed(
        [
            events.arrival(now, "r", now - 5, 7, {"traceparent": "x"}, {"a": 1}),
            events.queued(now + 1, "r"),
            events.scheduled(now + 2, "r"),
            events.preempted(now + 3, "r", "swap", 0.5, 11),
            events.scheduled(now + 4, "r"),
            events.generated(now + 5, "r", 2),
            events.token_out(now + 6, "r", 2),
            events.step(now, now + 6, 0, 1, 7, 0, 1, kv_usage=0.25, waiting=(3, "kv")),
            events.raw(now + 7, lambda tr, mono, p: expanded.append((tr, mono, p)), "payload"),
            events.finish(now + 8, "r", "ok", "stop"),
            (99, now, "r"),
        ]
    )
    (rec,), (step,) = t.take()
    wall = t.anchor.wall_ns
    assert (rec.request_id, rec.input_tokens, rec.trace_headers, rec.attrs) == ("r", 7, {"traceparent": "x"}, {"a": 1})
    assert rec.start_ns == wall(now - 5) and rec.queued_ns == wall(now + 1) and rec.first_scheduled_ns == wall(now + 2)
    assert rec.preemptions == [(wall(now + 3), wall(now + 4), "swap")] and rec.preemption_tokens == [11]
    assert rec.preemption_kv == [0.5] and rec.generated_tokens == 2 and list(rec.out_tokens) == [2]
    assert (rec.status, rec.finish_reason, rec.end_ns) == ("ok", "stop", wall(now + 8))
    assert (step.index, step.batch_size, step.prefill_tokens, step.preempted, step.kv_usage) == (0, 1, 7, 1, 0.25)
    assert (step.waiting, step.wait_reason) == (3, "kv")
    assert expanded == [(t, now + 7, "payload")] and t.unknown_events == 1


@pytest.fixture(params=[False, True], ids=["c", "python"])
def pure(request, monkeypatch) -> bool:
    from engine_hooks.hot_path import batch_scan

    c_or_python(monkeypatch, request.param, batch_scan._hotpath)
    return request.param


def test_the_c_accelerator_packs_the_declared_tuples(pure):
    """engine_hooks.hot_path._hotpath.MethodHook packs arrival and raw events itself: same arity and the
    same field at each declared index as the builders (and as the Python path)."""
    pipeline = TracingPipeline(None)
    hooks = EngineHooks(pipeline)
    expander = lambda tracker, mono, payload: None

    class Engine:
        @hooks.arrival_fields(lambda res, self, rid: (rid, None, 3, {"h": 1}, {"a": 2}))
        def add(self, rid):
            return rid

        @hooks.raw(payload=lambda res, self: ("payload", res), expander=expander)
        def step(self):
            return "out"

    assert (type(Engine.__dict__["add"]).__name__ == "MethodHook") is not pure
    e = Engine()
    e.add("r1")
    e.step()
    arrived, raw = pipeline.recorder.drain()
    a, r = events.BY_KIND[events.ARRIVAL], events.BY_KIND[events.RAW]
    assert len(arrived) == 1 + len(a.fields) and arrived[0] == events.ARRIVAL
    fields = {f: arrived[a.index(f)] for f in a.fields}
    assert fields == {**fields, "request_id": "r1", "start_mono": None, "input_tokens": 3}
    assert fields["trace_headers"] == {"h": 1} and fields["attrs"] == {"a": 2}
    assert len(raw) == 1 + len(r.fields) and raw[0] == events.RAW
    assert raw[r.index("expander")] is expander and raw[r.index("payload")] == ("payload", "out")
    assert type(raw[r.index("mono")]) is int and type(fields["mono"]) is int
