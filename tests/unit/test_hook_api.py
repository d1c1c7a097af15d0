"""The generic hook API as a new user's engine uses it: coroutine methods, generators that stream,
a hook for tokens generated apart from tokens handed out, methods that raise, strict mode for
tests, one default pipeline per setting, a GPU timer per hooks object."""

from __future__ import annotations

import asyncio
import sys

import pytest
from conftest import ROOT, c_or_python
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine_hooks import CudaEventTimer, EngineHooks, TracingPipeline, default_pipeline
from otel_llm import semconv as sc

sys.path.insert(0, str(ROOT / "examples"))


def spans_by_request(mem) -> dict[str, dict[str, object]]:
    """{request id: {span name: span}} of the request spans and their children."""
    spans = mem.get_finished_spans()
    roots = {s.context.span_id: s for s in spans if s.name == sc.SPAN_REQUEST}
    out = {r.attributes[sc.REQUEST_ID]: {sc.SPAN_REQUEST: r} for r in roots.values()}
    for s in spans:
        if s.parent is not None and s.parent.span_id in roots:
            out[roots[s.parent.span_id].attributes[sc.REQUEST_ID]][s.name] = s
    return out


def test_the_async_example_engine_gets_every_span():
    """examples/async_engine.py (async def methods, an awaited 5 ms forward pass, an async
    generator stream): every phase span, steps as long as the await, prefill ending when the
    first token was generated, before it was handed out."""
    import async_engine

    mem = InMemorySpanExporter()
    pipeline = TracingPipeline(mem, service_name="async")
    async_engine.hooks.use(pipeline)
    asyncio.run(_run(async_engine))
    pipeline.process(final=True)
    assert pipeline.counters.hook_errors == 0
    reqs = spans_by_request(mem)
    assert set(reqs) == {f"a{i}" for i in range(4)}
    for rid, got in reqs.items():
        assert {sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE, sc.SPAN_STREAM} <= set(got), (rid, set(got))
        req = got[sc.SPAN_REQUEST]
        a = req.attributes
        assert a[sc.STATUS] == "ok" and a[sc.OUTPUT_TOKENS] == 8 and len(a[sc.TOKEN_EVENT_OFFSETS]) == 8
        gen, out = a[sc.TOKEN_GENERATED_OFFSETS], a[sc.TOKEN_EVENT_OFFSETS]
        assert len(gen) == 8 and all(g <= o for g, o in zip(gen, out))
        assert got[sc.SPAN_PREFILL].end_time == req.start_time + gen[0] < req.start_time + out[0] + 1
    steps = [s for s in mem.get_finished_spans() if s.name == sc.SPAN_STEP]
    assert len(steps) == 8 and all(s.end_time - s.start_time >= 5_000_000 for s in steps)
    assert [s.attributes[sc.STEP_BATCH_SIZE] for s in steps] == [4] * 8


async def _run(async_engine):
    engine = async_engine.AsyncEngine()
    for i in range(4):
        await engine.add_request(f"a{i}", 8)

    async def read(rid):
        return [t async for t in engine.stream(rid)]

    got = await asyncio.gather(engine.run_steps(), *(read(f"a{i}") for i in range(4)))
    assert [len(g) for g in got[1:]] == [8] * 4  # the caller sees what it would see untraced


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_method_that_raises_finishes_its_request(kind):
    """The exception reaches the caller unchanged; the request ends (rejected at arrival, error
    elsewhere) with the exception's type, instead of staying in flight."""
    mem = InMemorySpanExporter()
    hooks = EngineHooks(TracingPipeline(mem), engine="e")

    def body(rid, fail):
        if fail:
            raise KeyError(rid)

    if kind == "async":

        async def add(rid, fail):
            body(rid, fail)

        async def emit(rid, fail):
            body(rid, fail)

        call = asyncio.run
    else:
        add = emit = body
        call = lambda x: x
    add = hooks.arrival(request_id=lambda res, rid, fail: rid)(add)
    emit = hooks.token_out(outputs=lambda _, rid, fail: [(rid, 1)])(emit)
    with pytest.raises(KeyError):
        call(add("refused", True))
    call(add("broken", False))
    with pytest.raises(KeyError):
        call(emit("broken", True))
    hooks.pipeline.process()
    reqs = spans_by_request(mem)
    refused, broken = reqs["refused"][sc.SPAN_REQUEST].attributes, reqs["broken"][sc.SPAN_REQUEST].attributes
    assert refused[sc.STATUS] == "rejected" and refused[sc.ERROR_TYPE] == "KeyError"
    assert broken[sc.STATUS] == "error" and broken[sc.ERROR_TYPE] == "KeyError"
    assert broken[sc.OUTPUT_TOKENS] == 1  # the tokens it handed out before it failed
    assert hooks.pipeline.tracker.live == {}


def test_strict_mode_raises_a_wrong_extractor_at_once(monkeypatch):
    """A hook whose extractor has the wrong signature: counted and warned about normally; in
    strict mode (the argument, or OTEL_LLM_STRICT=1) the TypeError is raised at the first call."""

    def engine(hooks):
        @hooks.arrival(request_id=lambda res, self: "x")  # the method takes (self, req)
        def add(self, req):
            return req

        return add

    lax = EngineHooks(TracingPipeline(None))
    assert engine(lax)(None, "r") == "r" and lax.pipeline.counters.hook_errors == 1
    with pytest.raises(TypeError):
        engine(EngineHooks(TracingPipeline(None), strict=True))(None, "r")
    monkeypatch.setenv("OTEL_LLM_STRICT", "1")
    with pytest.raises(TypeError):
        engine(EngineHooks(TracingPipeline(None)))(None, "r")


def test_one_default_pipeline_per_setting():
    a = default_pipeline(engine="one", service_name="one")
    assert default_pipeline(engine="one", service_name="one") is a
    b = default_pipeline(engine="two", service_name="two")
    assert b is not a and b.factory.engine == "two" and a.factory.engine == "one"


class Timer:
    """A GPU timer's interface (start / stop / elapsed_ns) with a fixed answer."""

    def __init__(self, ns):
        self.ns = ns

    def start(self):
        return [None]

    def stop(self, handle):
        handle[0] = True

    def elapsed_ns(self, handle):
        return self.ns


def test_each_hooks_object_reads_back_its_own_gpu_timer():
    """vLLM's front end and engine core in one process share a pipeline: a GPU timer given to one
    hooks object is not lost on the shared pipeline, nor read by another's."""
    mem = InMemorySpanExporter()
    pipeline = TracingPipeline(mem)
    for ns in (111, 222):
        hooks = EngineHooks(pipeline, gpu_timer=Timer(ns))
        sched = hooks.schedule()(lambda: "plan")
        step = hooks.step(batch_size=lambda res, plan, ns=ns: ns)(lambda plan: plan)
        step(sched())
    plain = EngineHooks(pipeline)
    plain.step(batch_size=lambda res, plan: 0)(lambda plan: plan)(plain.schedule()(lambda: "plan")())
    pipeline.process()
    got = {
        s.attributes[sc.STEP_BATCH_SIZE]: s.attributes.get(sc.STEP_GPU_TIME_NS)
        for s in mem.get_finished_spans()
        if s.name == sc.SPAN_STEP
    }
    assert got == {111: 111, 222: 222, 0: None}
    assert CudaEventTimer.if_available() is None  # this machine has no CUDA: no timer, no attribute


@pytest.mark.parametrize("detail", ["request", "phases"])
def test_the_gpu_timer_records_nothing_where_no_step_span_is_sent(detail):
    """Below ``steps`` no step span carries a GPU time, so no CUDA event is recorded for one (each
    record costs the engine's thread about 6 us on an H200); at ``steps`` every step is timed."""

    class Counting(Timer):
        started = 0

        def start(self):
            Counting.started += 1
            return super().start()

    for level, expected in ((detail, 0), ("steps", 3)):
        Counting.started = 0
        mem = InMemorySpanExporter()
        hooks = EngineHooks(TracingPipeline(mem, detail=level), gpu_timer=Counting(5))
        sched = hooks.schedule()(lambda: "plan")
        step = hooks.step(batch_size=lambda res, plan: 1)(lambda plan: plan)
        for _ in range(3):
            step(sched())
        hooks.pipeline.process()
        assert Counting.started == expected
        gpu = [s.attributes.get(sc.STEP_GPU_TIME_NS) for s in mem.get_finished_spans() if s.name == sc.SPAN_STEP]
        assert gpu == ([5, 5, 5] if level == "steps" else [])


@pytest.fixture(params=[False, True], ids=["c", "python"])
def pure(request, monkeypatch) -> bool:
    """The hooks as the accelerator builds them (engine_hooks.hot_path._hotpath), then in pure Python."""
    from engine_hooks.hot_path import batch_scan

    c_or_python(monkeypatch, request.param, batch_scan._hotpath)
    return request.param


def test_a_raw_hook_passes_every_argument_and_result_through(pure):
    """EngineHooks.raw on a plain method (in C where the accelerator is built,
    engine_hooks.hot_path._hotpath.MethodHook): the method gets its caller's arguments as they were given
    (positional, keyword, many), bound to the instance it is read from; the payload gets the result
    and the same arguments; the event is (RAW, monotonic ns, expander, payload); what the method
    raises goes on untouched with nothing recorded; what the payload raises is counted and the
    caller gets the result all the same (strict: raised); a KeyboardInterrupt is never swallowed."""
    import time

    from engine_hooks.api import hooked
    from engine_hooks.hot_path.hook_events import RAW

    pipeline = TracingPipeline(None)
    hooks = EngineHooks(pipeline)
    expander = lambda tracker, mono, payload: None
    calls = []

    def payload(res, *a, **k):
        if k.get("boom"):
            raise KeyError("boom")
        if k.get("stop"):
            raise KeyboardInterrupt
        calls.append((res, a, k))
        return ("p", res)

    class Engine:
        def step(self, *args, **kwargs):
            """the engine's own docstring"""
            if kwargs.get("fail"):
                raise ValueError("the engine's own")
            return ("out", args, kwargs)

    Engine.step = hooks.raw(payload=payload, expander=expander)(Engine.step)
    assert (type(Engine.__dict__["step"]).__name__ == "MethodHook") is not pure
    assert (
        hooked(Engine.step) and Engine.step.__name__ == "step" and Engine.step.__doc__ == "the engine's own docstring"
    )
    e = Engine()
    many = tuple(range(20))  # more than the C path passes on the stack
    t0 = time.monotonic_ns()
    assert e.step(1, 2, x=3) == ("out", (1, 2), {"x": 3})
    assert e.step(*many, **{f"k{i}": i for i in range(5)}) == ("out", many, {f"k{i}": i for i in range(5)})
    assert Engine.step(e, 9) == ("out", (9,), {})  # read from the class: unbound, as a function is
    assert [c[1][0] for c in calls] == [e, e, e] and calls[0] == (("out", (1, 2), {"x": 3}), (e, 1, 2), {"x": 3})
    assert calls[1][1][1:] == many and calls[1][2] == {f"k{i}": i for i in range(5)}
    events = pipeline.recorder.drain()
    assert [ev[0] for ev in events] == [RAW] * 3 and all(ev[2] is expander for ev in events)
    assert [ev[3] for ev in events] == [("p", c[0]) for c in calls]
    assert t0 <= events[0][1] <= events[1][1] <= events[2][1] <= time.monotonic_ns()
    with pytest.raises(ValueError, match="the engine's own"):
        e.step(fail=True)
    assert pipeline.recorder.drain() == [] and len(calls) == 3
    assert e.step(boom=True) == ("out", (), {"boom": True})  # the hook failed, the engine did not
    assert pipeline.counters.hook_errors == 1 and pipeline.recorder.drain() == []
    with pytest.raises(KeyboardInterrupt):
        e.step(stop=True)
    strict = EngineHooks(TracingPipeline(None), strict=True)
    Engine.strict = strict.raw(payload=payload, expander=expander)(Engine.step.__wrapped__)
    with pytest.raises(KeyError, match="boom"):
        e.strict(boom=True)
    # the hooks' pipeline is looked up at each call: one given later is the one recorded to
    late = EngineHooks()
    Engine.late = late.raw(payload=payload, expander=expander)(Engine.step.__wrapped__)
    other = TracingPipeline(None)
    late.use(other)
    e.late(5)
    assert [ev[3] for ev in other.recorder.drain()] == [("p", ("out", (5,), {}))]


def test_an_arrival_hook_records_what_its_fields_say(pure):
    """EngineHooks.arrival_fields on a plain method (in C where the accelerator is built): one
    ARRIVAL event with the start placed on the monotonic clock as its age (an int or a float of
    wall ns); nothing for a request without an id; a fields function that raises is counted; a
    method that raises records the request arrived and rejected, and its exception goes on."""
    import time

    from engine_hooks.hot_path.hook_events import ARRIVAL, FINISH

    pipeline = TracingPipeline(None)
    hooks = EngineHooks(pipeline)

    def fields(res, self, rid, age_s=0.0, as_float=False, **k):
        if rid == "boom":
            raise KeyError(rid)
        start = time.time_ns() - int(age_s * 1e9)
        return rid, float(start) if as_float else start, 7, {"traceparent": "x"}, {"a": 1}

    class Engine:
        def add(self, rid, age_s=0.0, as_float=False, fail=False):
            if fail:
                raise ValueError("refused")
            return "added"

    Engine.add = hooks.arrival_fields(fields)(Engine.add)
    assert (type(Engine.__dict__["add"]).__name__ == "MethodHook") is not pure
    e = Engine()
    t0 = time.monotonic_ns()
    assert e.add("r1", age_s=0.5) == "added" and e.add("r2", 0.25, as_float=True) == "added"
    assert e.add(None) == "added" and e.add("boom") == "added"
    t1 = time.monotonic_ns()
    events = pipeline.recorder.drain()
    assert [ev[:3] for ev in events] == [(ARRIVAL, ev[1], r) for ev, r in zip(events, ["r1", "r2"])]
    assert all(t0 <= ev[1] <= t1 and ev[4:] == (7, {"traceparent": "x"}, {"a": 1}) for ev in events)
    assert events[0][1] - events[0][3] == pytest.approx(0.5e9, abs=0.05e9)  # its age, on the monotonic clock
    assert events[1][1] - events[1][3] == pytest.approx(0.25e9, abs=0.05e9)
    assert pipeline.counters.hook_errors == 1  # the fields that raised
    with pytest.raises(ValueError, match="refused"):
        e.add("r3", fail=True)
    ev = pipeline.recorder.drain()
    assert [x[0] for x in ev] == [ARRIVAL, FINISH] and ev[0][2] == ev[1][2] == "r3"
    assert ev[1][3:] == ("rejected", "ValueError")
