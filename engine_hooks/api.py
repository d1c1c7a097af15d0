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
include ``self`` for methods); ``token_out``'s is called before, with ``result=None``. They run on the engine's
thread, so keep them to attribute reads; anything that must walk a batch can be deferred with
:meth:`EngineHooks.raw`, which keeps a reference and unpacks it on the span-building thread. A
hook that raises never reaches the engine: the failure is counted and warned about once.

Times: monotonic ns, taken when the decorated method returns (``schedule``: when it starts).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from otel_llm.clock import monotonic_ns

from .pipeline import TracingPipeline, default_pipeline
from .recorder import ARRIVAL, FINISH, PREEMPTED, RAW, SCHEDULED, STEP, TOKEN_OUT

Extractor = Callable[..., Any]


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
    ):
        self._pipeline = pipeline
        self._engine, self._model, self._service = engine, model, service_name or engine or "llm-engine"
        self.gpu_timer = gpu_timer
        self._step_index = 0
        self._iter_start: dict[Any, tuple[int, Any]] = {}

    @property
    def pipeline(self) -> TracingPipeline:
        """The pipeline events go to: the one given, else the process's default pipeline
        (configured from the environment), created on first use, not at decoration time."""
        if self._pipeline is None:
            self._pipeline = default_pipeline(
                engine=self._engine,
                model=self._model,
                service_name=self._service,
                gpu_elapsed=self.gpu_timer.elapsed_ns if self.gpu_timer else None,
            )
        return self._pipeline

    def use(self, pipeline: TracingPipeline) -> EngineHooks:
        """Send this object's events to ``pipeline`` from now on."""
        self._pipeline = pipeline
        self.__dict__.pop("_rec", None)
        return self

    def _rec(self, event: tuple) -> None:
        # first call binds the recorder's append directly (an instance attribute shadows this method)
        self._rec = self.pipeline.recorder.record
        self._rec(event)

    def _wrap(self, fn: Callable, after: Callable[[Any, tuple, dict], None], before=None) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            pre = None
            if before is not None:
                try:
                    pre = before(args, kwargs)
                except Exception as exc:
                    self.pipeline.hook_failed(exc)
            result = fn(*args, **kwargs)
            try:
                after(result, args, kwargs, pre)
            except Exception as exc:
                self.pipeline.hook_failed(exc)
            return result

        return mark_hooked(wrapper)

    # -- the six lifecycle decorators ------------------------------------------------------------
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
        of the arrival, if the engine knows it better than the hook's own time."""

        def deco(fn):
            def after(res, a, k, _):
                self._rec(
                    (
                        ARRIVAL,
                        monotonic_ns(),
                        request_id(res, *a, **k),
                        start_time_ns(res, *a, **k) if start_time_ns else None,
                        input_tokens(res, *a, **k) if input_tokens else None,
                        trace_headers(res, *a, **k) if trace_headers else None,
                        attributes(res, *a, **k) if attributes else None,
                    )
                )

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
                handle = self.gpu_timer.start() if self.gpu_timer is not None else None
                self._iter_start[key(res, *a, **k) if key else None] = (t0, handle)
                if scheduled is not None:
                    t = monotonic_ns()
                    for rid in scheduled(res, *a, **k) or ():
                        self._rec((SCHEDULED, t, rid))

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
    ):
        """Ends the iteration begun by the matching :meth:`schedule` call and records an
        ``llm.engine.step`` span (GPU time too, when a GPU timer is set). ``tokens`` may replace
        ``prefill_tokens`` and ``decode_tokens`` when one pass gives both: it returns the pair."""

        def deco(fn):
            zero = _const(0)
            bs, pr = (batch_size or zero), (preempted or zero)
            pf, dc = (prefill_tokens or zero), (decode_tokens or zero)
            split = tokens or (lambda res, *a, **k: (pf(res, *a, **k), dc(res, *a, **k)))

            def before(a, k):
                start = self._iter_start.pop(key(None, *a, **k) if key else None, None)
                if start is not None and start[1] is not None:
                    self.gpu_timer.stop(start[1])  # recorded when the step's output is back
                return start

            def after(res, a, k, start):
                t1 = monotonic_ns()
                t0, handle = start if start is not None else (t1, None)
                idx = self._step_index
                self._step_index = idx + 1
                prefill, decode = split(res, *a, **k)
                self._rec(
                    (
                        STEP,
                        t0,
                        t1,
                        idx,
                        bs(res, *a, **k),
                        prefill,
                        decode,
                        pr(res, *a, **k),
                        kv_usage(res, *a, **k) if kv_usage else None,
                        handle,
                    )
                )

            return self._wrap(fn, after, before)

        return deco

    def preempt(self, request_id: Extractor, mode: str | Extractor = "recompute"):
        """A request was preempted (``mode``: ``recompute`` or ``swap``); it is back in when
        :meth:`schedule` reports it scheduled again."""
        mode_fn = mode if callable(mode) else _const(mode)

        def deco(fn):
            def after(res, a, k, _):
                self._rec((PREEMPTED, monotonic_ns(), request_id(res, *a, **k), mode_fn(res, *a, **k)))

            return self._wrap(fn, after)

        return deco

    def token_out(self, outputs: Extractor):
        """Output handed to the transport. ``outputs``: iterable of ``(request_id, tokens)``.
        Recorded when the method is *called* (its extractor gets ``result=None``), so that a
        ``finish`` hook running inside it comes after the tokens it hands out."""

        def deco(fn):
            def before(a, k):
                t = monotonic_ns()
                for rid, n in outputs(None, *a, **k) or ():
                    self._rec((TOKEN_OUT, t, rid, n))

            return self._wrap(fn, lambda res, a, k, pre: None, before)

        return deco

    def finish(self, request_id: Extractor, status: str | Extractor = "ok", reason: Extractor | None = None):
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
                    self._rec((FINISH, t, rid, st, rs))

            return self._wrap(fn, after)

        return deco

    def raw(self, payload: Extractor, expander: Callable):
        """Keep a reference to ``payload(result, *args, **kwargs)`` and call
        ``expander(tracker, mono_ns, payload)`` later, on the span-building thread: O(1) on the
        engine's thread for whatever the payload holds."""

        def deco(fn):
            def after(res, a, k, _):
                self._rec((RAW, monotonic_ns(), expander, payload(res, *a, **k)))

            return self._wrap(fn, after)

        return deco


_HOOKED = "__otel_llm_hooked__"


def mark_hooked(fn: Callable) -> Callable:
    """Mark a function as one of ours (a hook wrapper, a traced constructor); returns it."""
    setattr(fn, _HOOKED, True)
    return fn


def hooked(fn: Callable) -> bool:
    """Whether ``fn`` already carries an otel-llm hook (hooks are never applied twice)."""
    return bool(getattr(fn, _HOOKED, False))
