"""The generic hook API: mark an engine's lifecycle methods, get the spans of docs/architecture.md.

One decorator per lifecycle method::

    hooks = EngineHooks(engine="my-engine", model="tiny")

    class MyEngine:
        @hooks.arrival(request_id=lambda res, self, req: req.id,
                       input_tokens=lambda res, self, req: len(req.prompt))
        def add_request(self, req): ...

        @hooks.schedule(scheduled=lambda res, self: [r.id for r in res.admitted])
        def schedule(self): ...            # starts an engine iteration

        @hooks.step(batch_size=lambda res, self, plan: len(plan.batch))
        def run_step(self, plan): ...     # ends the iteration begun by the last schedule()

        @hooks.preempt(request_id=lambda res, self, req: req.id)
        def preempt(self, req): ...

        @hooks.token_out(outputs=lambda _, self, outs: [(o.id, o.n) for o in outs])
        def emit(self, outs): ...

        @hooks.finish(request_id=lambda res, self, req, status: req.id,
                      status=lambda res, self, req, status: status)
        def finish(self, req, status): ...

**Extractors** are called after the method returns, as ``fn(result, *args, **kwargs)`` (``args``
include ``self`` for methods); ``token_out``'s and ``generated``'s are called before, with
``result=None``. They run on the engine's thread, so keep them to attribute reads; anything that
must walk a batch can be deferred with :meth:`EngineHooks.raw`, which keeps a reference and
unpacks it on the span-building thread (or, its payload made plain data, :func:`plain_payload`,
in the span process). A plain (not coroutine or generator) method hooked by ``raw`` or
``arrival_fields`` is wrapped in C where the accelerator is built
(``engine_hooks.hot_path._hotpath.MethodHook``: the same calls, no Python frame of ours around the
engine's method). A hook that raises never reaches the engine: the failure is
counted and warned about once (``EngineHooks(strict=True)`` or ``OTEL_LLM_STRICT=1``: it raises,
for tests).

**Coroutines and generators.** ``async def`` methods are awaited: the hook's time is when the
coroutine completes (``schedule``: when it is called). A generator method (``def`` or ``async
def`` with ``yield``) that streams: ``token_out`` / ``generated`` record each yielded item
(``outputs(item, *args, **kwargs)``); the other hooks run when it is exhausted, with
``result=None``.

**A method that raises.** Its after-hook is skipped, and the requests it names (its extractor
called with ``result=None``) finish: ``rejected`` for ``arrival`` (the request never got in),
``error`` for the others, the exception's type as the reason (``error.type`` on the span). The
exception goes on to the caller unchanged.

Times: monotonic ns, taken when the decorated method returns (``schedule``: when it starts).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

from otel_llm import environment
from otel_llm.clock import monotonic_ns
from otel_llm.environment import Detail
from otel_llm.semconv import RequestStatus

from .hot_path import hook_events as events
from .hot_path.batch_scan import _hotpath, accelerated
from .pipeline import TracingPipeline, default_pipeline

Extractor = Callable[..., Any]


_UNSET = object()


def _const(v):
    return lambda *a, **k: v


class EngineHooks:
    def __init__(
        self,
        pipeline: TracingPipeline | None = None,
        *,
        engine: str | None = None,
        model: str | None = None,
        service_name: str | None = None,
        gpu_timer=None,
        strict: bool | None = None,
        detail: str | None = None,
    ):
        self._pipeline = pipeline
        self._detail = detail  # request | phases | steps (default: OTEL_LLM_DETAIL, else phases)
        self._engine, self._model, self._service = engine, model, service_name or engine or "llm-engine"
        self.gpu_timer = gpu_timer
        self.strict = environment.env_bool(environment.STRICT) if strict is None else strict
        self._step_index = 0
        self._iter_start: dict[Any, tuple[int, Any]] = {}

    @property
    def detail(self) -> str:
        """The detail level these hooks record for: the given one, else ``OTEL_LLM_DETAIL``, else
        ``phases`` (read without starting the pipeline)."""
        if self._pipeline is not None:
            return self._pipeline.detail
        return self._detail or environment.detail_level()

    @property
    def has_pipeline(self) -> bool:
        """Whether these hooks have a pipeline yet (given, or made by a first event)."""
        return self._pipeline is not None

    @property
    def pipeline(self) -> TracingPipeline:
        """The pipeline events go to: the one given, else the process's default pipeline
        (configured from the environment), created on first use, not at decoration time."""
        if self._pipeline is None:
            extra = {"detail": self._detail} if self._detail else {}
            self._pipeline = default_pipeline(
                engine=self._engine, model=self._model, service_name=self._service, **extra
            )
        return self._pipeline

    def use(self, pipeline: TracingPipeline) -> EngineHooks:
        """Send this object's events to ``pipeline`` from now on."""
        self._pipeline = pipeline
        self.__dict__.pop("_rec", None)
        self.__dict__.pop("_timer_in_use", None)
        return self

    def _rec(self, event: tuple) -> None:
        # first call binds the recorder's append directly (an instance attribute shadows this method)
        self._rec = self.pipeline.recorder.record
        self._rec(event)

    def _step_timer(self):
        """The GPU timer where its times are sent (step spans, detail ``steps``), else None: at the
        other levels nothing would read its events back, so none are recorded. Decided on first
        use, as the pipeline is."""
        timer = self.__dict__.get("_timer_in_use", _UNSET)
        if timer is _UNSET:
            on = self.gpu_timer is not None and self.pipeline.detail == Detail.STEPS
            timer = self._timer_in_use = self.gpu_timer if on else None
        return timer

    def _hook_failed(self, exc: Exception) -> None:
        if self.strict:
            raise exc
        self.pipeline.hook_failed(exc)

    def _guard(self, hook: Callable | None, *args) -> Any:
        """Run one hook; a failure is counted (strict: raised), never the engine's problem."""
        if hook is None:
            return None
        try:
            return hook(*args)
        except Exception as exc:
            self._hook_failed(exc)
            return None

    def _on_method_error(
        self, failed: Callable[[BaseException, tuple, dict], None] | None
    ) -> Callable[[BaseException, tuple, dict], None]:
        """What runs when a traced method raises (``_wrap``'s wrappers and the accelerator's
        ``MethodHook``): ``failed(exc, args, kwargs)``, guarded, unless there is none or the method
        was only ended (a stream closed early, a task cancelled); the exception then goes on."""
        guard = self._guard

        def on_error(exc: BaseException, args: tuple, kwargs: dict) -> None:
            if failed is not None and not isinstance(exc, _NOT_FAILED):
                guard(failed, exc, args, kwargs)

        return on_error

    def _wrap(
        self,
        fn: Callable,
        after: Callable[[Any, tuple, dict, Any], None],
        before: Callable[[tuple, dict], Any] | None = None,
        failed: Callable[[BaseException, tuple, dict], None] | None = None,
        item: Callable[[Any, tuple, dict], None] | None = None,
    ) -> Callable:
        """The traced method, of the same kind as ``fn`` (plain, coroutine, generator, async
        generator). ``item``: called for each item a generator yields; ``failed``: when ``fn``
        raises (the exception then goes on)."""
        guard, hook_failed = self._guard, self._hook_failed
        on_error = self._on_method_error(failed)

        if inspect.isasyncgenfunction(fn):

            async def wrapper(*args, **kwargs):
                pre = guard(before, args, kwargs) if before is not None else None
                agen = fn(*args, **kwargs)
                try:
                    async for x in agen:
                        if item is not None:
                            guard(item, x, args, kwargs)
                        yield x
                except BaseException as exc:
                    on_error(exc, args, kwargs)
                    raise
                finally:
                    await agen.aclose()
                guard(after, None, args, kwargs, pre)

        elif inspect.isgeneratorfunction(fn):

            def wrapper(*args, **kwargs):
                pre = guard(before, args, kwargs) if before is not None else None
                gen = fn(*args, **kwargs)
                try:
                    for x in gen:
                        if item is not None:
                            guard(item, x, args, kwargs)
                        yield x
                except BaseException as exc:
                    on_error(exc, args, kwargs)
                    raise
                finally:
                    gen.close()
                guard(after, None, args, kwargs, pre)

        elif inspect.iscoroutinefunction(fn):

            async def wrapper(*args, **kwargs):
                pre = guard(before, args, kwargs) if before is not None else None
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as exc:
                    on_error(exc, args, kwargs)
                    raise
                try:  # guard(), written out: this runs at every engine step
                    after(result, args, kwargs, pre)
                except Exception as exc:
                    hook_failed(exc)
                return result

        else:

            def wrapper(*args, **kwargs):
                pre = guard(before, args, kwargs) if before is not None else None
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    on_error(exc, args, kwargs)
                    raise
                try:  # guard(), written out: this runs at every engine step
                    after(result, args, kwargs, pre)
                except Exception as exc:
                    hook_failed(exc)
                return result

        return mark_hooked(functools.wraps(fn)(wrapper))

    def _finish_failed(self, ids, status: str, exc: BaseException) -> None:
        """The requests a method that raised was about: they end here, with the exception's type."""
        t = monotonic_ns()
        for rid in [ids] if isinstance(ids, str) else (ids or ()):
            self._rec(events.finish(t, rid, status, type(exc).__name__))

    # -- the lifecycle decorators ------------------------------------------------------------------
    def arrival(
        self,
        request_id: Extractor,
        input_tokens: Extractor | None = None,
        trace_headers: Extractor | None = None,
        start_time_ns: Extractor | None = None,
        attributes: Extractor | None = None,
    ):
        """A request arrived at the engine front end. ``trace_headers``: a W3C carrier
        (``traceparent``) whose trace the request's spans join. ``start_time_ns``: wall-clock ns
        of the arrival, if the engine knows it better than the hook's own time (vLLM stamps it
        with ``time.time()`` before tokenizing). It is taken as an age, read against the wall clock
        now, and placed on the monotonic clock like every other event: a wall-clock time compared
        with the process's anchor would move by every step or slew of the system clock since the
        anchor was taken (40 ms put a request's tokens before its arrival). If the method raises,
        the request is recorded as arrived and ``rejected``."""

        def fields(res, *a, **k):
            return (
                request_id(res, *a, **k),
                start_time_ns(res, *a, **k) if start_time_ns else None,
                input_tokens(res, *a, **k) if input_tokens else None,
                trace_headers(res, *a, **k) if trace_headers else None,
                attributes(res, *a, **k) if attributes else None,
            )

        return self.arrival_fields(fields)

    def arrival_fields(self, fields: Extractor):
        """:meth:`arrival` with its extractors in one: ``fields(result, *args, **kwargs)`` gives
        ``(request_id, start_time_ns, input_tokens, trace_headers, attributes)``, each but the id
        possibly None (one call a request, where an engine's adapter reads them all from one
        object)."""

        def arrived(res, a, k):
            rid, start, *rest = fields(res, *a, **k)
            if rid is None:  # the engine refused it without an id (nothing to trace)
                return
            now = monotonic_ns()
            if start is not None:  # arrived no later than this hook ran
                start = now - max(0, time.time_ns() - start)
            self._rec(events.arrival(now, rid, start, *rest))

        def deco(fn):
            def failed(exc, a, k):
                arrived(None, a, k)
                self._finish_failed(fields(None, *a, **k)[0], RequestStatus.REJECTED, exc)

            if accelerated() and _plain(fn):  # _wrap's, with arrived() in it, in C: once a request
                on_error = self._on_method_error(failed)
                hook = _hotpath.MethodHook(fn, fields, None, self, self._hook_failed, on_error, events.ARRIVAL, True)
                return mark_hooked(functools.wraps(fn)(hook))
            return self._wrap(fn, lambda res, a, k, _: arrived(res, a, k), failed=failed)

        return deco

    def queued(self, request_id: Extractor):
        """A request entered the scheduler's queue: the front end's own work (arrival -> queued:
        tokenizing, hand-off to the engine loop) becomes ``llm.frontend``, and ``llm.queue`` starts
        here. ``request_id`` may return one id or several. Without this hook the queue starts at
        arrival."""

        def deco(fn):
            def after(res, a, k, _):
                t = monotonic_ns()
                ids = request_id(res, *a, **k)
                for rid in [ids] if isinstance(ids, str) else (ids or ()):
                    self._rec(events.queued(t, rid))

            return self._wrap(fn, after)

        return deco

    def schedule(self, scheduled: Extractor | None = None, key: Extractor | None = None):
        """Starts an engine iteration. ``scheduled``: ids of requests scheduled for the first time
        or again after a preemption. ``key``: identifies the iteration when several overlap
        (matched with the ``key`` of :meth:`step`)."""

        def deco(fn):
            def before(a, k):
                return monotonic_ns()

            def after(res, a, k, t0):
                timer = self._step_timer()
                handle = timer.start() if timer is not None else None
                self._iter_start[key(res, *a, **k) if key else None] = (t0 or monotonic_ns(), handle)
                if scheduled is not None:
                    t = monotonic_ns()
                    for rid in scheduled(res, *a, **k) or ():
                        self._rec(events.scheduled(t, rid))

            return self._wrap(fn, after, before)

        return deco

    def step(
        self,
        batch_size: Extractor | None = None,
        prefill_tokens: Extractor | None = None,
        decode_tokens: Extractor | None = None,
        preempted: Extractor | None = None,
        kv_usage: Extractor | None = None,
        key: Extractor | None = None,
        tokens: Extractor | None = None,
        waiting: Extractor | None = None,
        speculation: Extractor | None = None,
    ):
        """Ends the iteration begun by the matching :meth:`schedule` call and records an
        ``llm.engine.step`` span (GPU time too, when a GPU timer is set). ``tokens`` may replace
        ``prefill_tokens`` and ``decode_tokens`` when one pass gives both: it returns the pair.
        ``waiting`` returns (requests left waiting, why) after the step, why a short word or None.
        ``speculation`` returns (draft tokens the step verified, of them accepted), or None for a
        step that verified none; it is read *before* the method runs, with ``result=None`` (an
        engine may cut a stopped request's sampled tokens in place). A verify step's tokens (the
        request's last token and its drafts) are decode tokens."""

        def deco(fn):
            zero = _const(0)
            bs, pr = (batch_size or zero), (preempted or zero)
            pf, dc = (prefill_tokens or zero), (decode_tokens or zero)
            split = tokens or (lambda res, *a, **k: (pf(res, *a, **k), dc(res, *a, **k)))
            timer = self.gpu_timer

            def before(a, k):
                start = self._iter_start.pop(key(None, *a, **k) if key else None, None)
                if start is not None and start[1] is not None:
                    timer.stop(start[1])  # recorded when the step's output is back
                if speculation is None:
                    return start
                return start, self._guard(speculation, None, *a, **k)

            def after(res, a, k, pre):
                start, spec = (pre, None) if speculation is None else (pre or (None, None))
                t1 = monotonic_ns()
                t0, handle = start if start is not None else (t1, None)
                idx = self._step_index
                self._step_index = idx + 1
                prefill, decode = split(res, *a, **k)
                self._rec(
                    events.step(
                        t0,
                        t1,
                        idx,
                        bs(res, *a, **k),
                        prefill,
                        decode,
                        pr(res, *a, **k),
                        kv_usage=kv_usage(res, *a, **k) if kv_usage else None,
                        gpu_handle=None if handle is None else (timer, handle),  # read back by its own timer
                        waiting=waiting(res, *a, **k) if waiting else None,
                        speculation=spec,
                    )
                )

            return self._wrap(fn, after, before)

        return deco

    def preempt(
        self,
        request_id: Extractor,
        mode: str | Extractor = "recompute",
        kv_usage: Extractor | None = None,
        recompute_tokens: Extractor | None = None,
    ):
        """A request was preempted (``mode``: ``recompute`` or ``swap``); it is back in when
        :meth:`schedule` reports it scheduled again. ``kv_usage`` (the KV cache's used fraction,
        0..1) and ``recompute_tokens`` (the request's tokens whose KV it loses) are read *before*
        the method runs, with ``result=None``: the state that made the engine preempt. An engine
        whose requests are traced in another process (vLLM's engine core) gets one
        ``llm.engine.preemption`` span per preemption from them, named by ``llm.request.internal_id``."""
        mode_fn = mode if callable(mode) else _const(mode)
        state = None
        if kv_usage is not None or recompute_tokens is not None:
            kv_fn, tok_fn = kv_usage or _const(None), recompute_tokens or _const(None)
            state = lambda a, k: (kv_fn(None, *a, **k), tok_fn(None, *a, **k))

        def deco(fn):
            def after(res, a, k, pre):
                kv, tokens = pre if pre is not None else (None, None)
                self._rec(events.preempted(monotonic_ns(), request_id(res, *a, **k), mode_fn(res, *a, **k), kv, tokens))

            failed = lambda exc, a, k: self._finish_failed(request_id(None, *a, **k), RequestStatus.ERROR, exc)
            return self._wrap(fn, after, state, failed=failed)

        return deco

    def _tokens(self, build: Callable[[int, str, int], tuple], outputs: Extractor):
        """token_out and generated: ``(request_id, tokens)`` pairs, recorded when the method is
        called (a generator: for each item it yields)."""

        def record(res, a, k):
            t = monotonic_ns()
            for rid, n in outputs(res, *a, **k) or ():
                self._rec(build(t, rid, n))

        def failed(exc, a, k):
            self._finish_failed([rid for rid, _ in outputs(None, *a, **k) or ()], RequestStatus.ERROR, exc)

        def deco(fn):
            nothing = lambda res, a, k, pre: None
            if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
                return self._wrap(fn, nothing, item=record)
            return self._wrap(fn, nothing, lambda a, k: record(None, a, k), failed=failed)

        return deco

    def token_out(self, outputs: Extractor):
        """Output handed to the transport. ``outputs``: iterable of ``(request_id, tokens)``.
        Recorded when the method is *called* (its extractor gets ``result=None``), so that a
        ``finish`` hook running inside it comes after the tokens it hands out; a generator
        method: for each item it yields (``outputs(item, *args, **kwargs)``)."""
        return self._tokens(events.token_out, outputs)

    def generated(self, outputs: Extractor):
        """Tokens produced inside the engine (a forward pass's sampled tokens), before they are
        handed out: prefill ends at the first, and the stall analysis tells a late engine from a
        late delivery by them. ``outputs`` as for :meth:`token_out`. Without this hook the
        token-out times stand in."""
        return self._tokens(events.generated, outputs)

    def finish(
        self, request_id: Extractor, status: str | Extractor = RequestStatus.OK, reason: Extractor | None = None
    ):
        """A request finished (``status``: ok, error, cancelled or rejected). ``request_id`` may
        return one id or an iterable of ids."""
        status_fn = status if callable(status) else _const(status)

        def deco(fn):
            def after(res, a, k, _):
                t = monotonic_ns()
                ids = request_id(res, *a, **k)
                st = status_fn(res, *a, **k)
                rs = reason(res, *a, **k) if reason else None
                for rid in [ids] if isinstance(ids, str) else (ids or ()):
                    self._rec(events.finish(t, rid, st, rs))

            failed = lambda exc, a, k: self._finish_failed(request_id(None, *a, **k), RequestStatus.ERROR, exc)
            return self._wrap(fn, after, failed=failed)

        return deco

    def raw(self, payload: Extractor, expander: Callable, before: Extractor | None = None):
        """Keep a reference to ``payload(result, *args, **kwargs)`` and call
        ``expander(tracker, mono_ns, payload)`` later, on the span-building thread: O(1) on the
        engine's thread for whatever the payload holds. An expander marked with
        :func:`plain_payload` gets the payload made plain, and runs in the span process.
        ``before``: read with ``result=None`` before the method runs (what the method changes in
        place); the payload is then ``(before's value, payload's value)``."""

        def deco(fn):
            def after(res, a, k, pre):
                value = payload(res, *a, **k)
                self._rec(events.raw(monotonic_ns(), expander, value if before is None else (pre, value)))

            if before is not None:
                return self._wrap(fn, after, lambda a, k: before(None, *a, **k))
            if not _plain(fn):
                return self._wrap(fn, after)
            hook_failed = self._hook_failed
            if accelerated():  # the wrapper below, in C
                hook = _hotpath.MethodHook(fn, payload, expander, self, hook_failed, None, events.RAW, False)
                return mark_hooked(functools.wraps(fn)(hook))

            def wrapper(*args, **kwargs):  # _wrap's, with its hook written in: this runs at every engine step
                result = fn(*args, **kwargs)
                try:
                    self._rec(events.raw(monotonic_ns(), expander, payload(result, *args, **kwargs)))
                except Exception as exc:
                    hook_failed(exc)
                return result

            return mark_hooked(functools.wraps(fn)(wrapper))

        return deco


#: what ends a method without its having failed (a stream closed early, a task cancelled)
_NOT_FAILED = (GeneratorExit, asyncio.CancelledError)


def _plain(fn: Callable) -> bool:
    """Whether ``fn`` is a plain function (not a coroutine or generator function): its wrapper
    may be the accelerator's ``MethodHook``."""
    return not (inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn))


def plain_payload(to_plain: Callable[[Any], Any]) -> Callable[[Callable], Callable]:
    """Declare an expander's (:meth:`EngineHooks.raw`) payload convertible to plain data:
    ``to_plain(payload)`` gives it holding no engine object (only what pickles: numbers, strings,
    bytes, tuples, lists), the engine's objects read where they are. The expander is then given
    that plain payload, and with a span process it runs there: the engine's process only converts
    and sends (a steady decode step's payload can be sent as it is: ``to_plain`` returns it). The
    span process imports the expander by its module and name: a module-level function of an
    importable module (not ``__main__``; anything else runs in the engine's process, as without
    this)."""

    def deco(expander: Callable) -> Callable:
        expander.to_plain = to_plain
        return expander

    return deco


def _as_it_is(payload: Any) -> Any:
    return payload


#: an expander whose payload is plain already (ids, numbers): declared so that it runs in the span
#: process, beside the tracker's books
plain_already = plain_payload(_as_it_is)

_HOOKED = "__otel_llm_hooked__"


def mark_hooked(fn: Callable) -> Callable:
    """Mark a function as one of ours (a hook wrapper, a traced constructor); returns it."""
    setattr(fn, _HOOKED, True)
    return fn


def hooked(fn: Callable) -> bool:
    """Whether ``fn`` already carries an otel-llm hook (hooks are never applied twice)."""
    return bool(getattr(fn, _HOOKED, False))
