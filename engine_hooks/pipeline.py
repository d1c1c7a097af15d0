"""The tracing pipeline of one process: recorder -> tracker -> delivery (span factory -> exporter).

The engine's threads only touch the :class:`~engine_hooks.hot_path.recorder.Recorder`. A daemon thread
wakes every ``interval_s`` (``OTEL_LLM_SCHEDULE_DELAY`` ms, default 200: not the SDK's
``OTEL_BSP_SCHEDULE_DELAY``, whose default is 5000 ms; see :mod:`otel_llm.environment`), drains
the recorder into the tracker and delivers what finished: the spans are built with explicit times
and exported in batches of at most ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` (default 512), either on
this thread (:class:`~engine_hooks.spans.delivery.SpanBuilder`) or, for the exporter the environment
configures (:func:`default_pipeline`), in a span process of its own
(:mod:`engine_hooks.span_process.parent`; ``OTEL_LLM_SPAN_PROCESS=0``: on this thread), which takes
what costs most off the engine's process. Nothing here raises into the engine: failures are
counted in :class:`PipelineCounters` and warned about once. Spans are flushed at exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass

from opentelemetry.sdk.trace.export import SpanExporter

from otel_llm import environment
from otel_llm.clock import WallAnchor, monotonic_ns
from otel_llm.otlp.export import (
    SafeSpanExporter,
    destination,
    export_kind_from_env,
    exporter_from_env,
    takes_int_arrays,
)
from otel_llm.otlp.tracing import make_resource
from otel_llm.semconv import Boundary

from .hot_path.recorder import Recorder
from .span_process.export_queue import ExportQueue
from .span_process.parent import CallRecorder, SpanProcessSink
from .spans.delivery import SpanBuilder
from .spans.span_factory import SpanFactory
from .spans.tracker import RequestTracker

log = logging.getLogger("engine_hooks")


@dataclass
class PipelineCounters:
    events_dropped: int = 0  # recorder full
    spans_exported: int = 0
    spans_dropped: int = 0  # exporter failed
    requests_traced: int = 0
    requests_evicted: int = 0  # in-flight bound hit
    requests_unsampled: int = 0  # finished, but dropped by the sampler (OTEL_TRACES_SAMPLER)
    steps_traced: int = 0
    builder_errors: int = 0
    hook_errors: int = 0
    cpu_ns: int = 0  # CPU time of this pipeline's thread (thread time, ns): span building too, when in-process
    span_process_cpu_ns: int = 0  # CPU time of its span process, when it has one (ns)


class TracingPipeline:
    def __init__(
        self,
        exporter: SpanExporter | None = None,
        *,
        service_name: str = "llm-engine",
        engine: str | None = None,
        model: str | None = None,
        boundary: str = Boundary.ENGINE,
        interval_s: float | None = None,
        capacity: int | None = None,
        max_in_flight: int = 100_000,
        gpu_elapsed=None,
        resource_attrs: dict | None = None,
        detail: str | None = None,
        span_process: bool = False,
    ):
        """``exporter``: where the spans go (None: nowhere). ``span_process``: build and export
        them in a span process of its own, with the exporter the environment configures there
        (``exporter`` is then unused)."""
        self.detail = detail or environment.detail_level()
        if self.detail not in environment.DETAIL_LEVELS:
            raise ValueError(f"detail must be one of {', '.join(environment.DETAIL_LEVELS)}, got {detail!r}")
        self.recorder = Recorder(capacity or environment.env_int(environment.MAX_QUEUE_SIZE, 1 << 18, minimum=1))
        self.anchor = WallAnchor()
        grace_ms = environment.env_int(environment.ABORT_GRACE, 1000, minimum=0)
        self.tracker = RequestTracker(
            self.anchor, max_in_flight, gpu_elapsed=gpu_elapsed, abort_grace_ns=grace_ms * 10**6
        )
        self.factory = SpanFactory(make_resource(service_name, resource_attrs), boundary, engine, model, self.detail)
        delay_ms = environment.env_int(environment.SCHEDULE_DELAY, 200, minimum=1)
        self.interval_s = interval_s if interval_s is not None else delay_ms / 1000
        self.batch_size = environment.env_int(environment.BSP_MAX_EXPORT_BATCH_SIZE, 512, minimum=1)
        self._use_exporter(exporter)
        self.counters = PipelineCounters()
        self.gpu_elapsed = gpu_elapsed
        self.sink = SpanProcessSink(self._span_process_settings(), self.counters) if span_process else None
        self._calls = CallRecorder(self.anchor) if span_process else None
        self._lost_to_span_process = 0  # events sent to span processes that died before building them
        self._lock = threading.Lock()  # one builder at a time (thread vs flush)
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._hook_warned = False
        self._builder_warned = False
        self._from_env = False  # default_pipeline(): the exporter came from the environment
        # where the spans go, for the exit's line
        self.sends_to = destination() if span_process else type(exporter).__name__ if exporter else "nowhere"
        _live_pipelines.add(self)

    # -- hot path helpers ------------------------------------------------------------------------
    def hook_failed(self, exc: BaseException) -> None:
        """A hook raised: count it, warn once. Never re-raises."""
        self.counters.hook_errors += 1
        if not self._hook_warned:
            self._hook_warned = True
            log.warning(
                "engine_hooks: a tracing hook failed (%s: %s); the engine goes on, failures are counted",
                type(exc).__name__,
                exc,
            )

    def start(self) -> TracingPipeline:
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name="otel-llm-spans", daemon=True)
            self._thread.start()
            if self._from_env:  # what tracing costs this process, beside its spans (engine_hooks.spans.self_metrics)
                from .spans import self_metrics

                self_metrics.start(_live_pipelines, self.factory.resource)
        return self

    # -- builder side ---------------------------------------------------------------------------
    def _run(self) -> None:
        if self.sink is not None:  # up before the first round: the first spans are not late for it
            with self._lock:
                self.sink.start()
        while not self._stopped:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self.process()

    def process(self, final: bool = False, everything: bool = False) -> int:
        """Drain, build and export; returns the number of spans handed to the exporter.
        ``everything``: aborted requests too, without waiting out their grace (a flush)."""
        with self._lock:
            t0 = time.thread_time_ns()
            try:
                return self._process(final, everything)
            finally:
                self.counters.cpu_ns += time.thread_time_ns() - t0

    def _process(self, final: bool, everything: bool = False) -> int:
        """:meth:`process` under its lock."""
        try:
            sink = self.sink
            if sink is not None:
                if not sink.failed:
                    return self._send(final, everything)
                self._build_here()
            self.tracker.feed(self.recorder.drain())
            return self.deliver_round(final, everything)
        except Exception as exc:
            self._builder_failed(exc)
            return 0

    def _use_exporter(self, exporter: SpanExporter | None, queued: bool = False) -> None:
        """Build and export on this pipeline's thread, to ``exporter`` (None: nowhere); ``queued``:
        its sends on a thread of their own, behind a bounded queue (:class:`ExportQueue`)."""
        if exporter is None:
            self.exporter = None
        elif queued:
            self.exporter = ExportQueue(exporter, environment.env_int(environment.EXPORT_QUEUE_SIZE, 8192, minimum=1))
        else:
            self.exporter = SafeSpanExporter(exporter, "engine_hooks")
        self.factory.int_arrays = takes_int_arrays(self.exporter)
        self.builder = SpanBuilder(self.factory, self.exporter, self.batch_size)

    def use_env_exporter(self) -> None:
        """Export to what the environment configures; an OTLP exporter (which may wait on its
        endpoint for ``OTEL_EXPORTER_OTLP_TIMEOUT`` and its retries) behind an export queue."""
        try:
            kind = export_kind_from_env()
        except ValueError:
            kind = None  # exporter_from_env_or_none says why
        self._use_exporter(exporter_from_env_or_none(), queued=kind in ("grpc", "http"))
        self.sends_to = destination()

    def _build_here(self) -> None:
        """The span process could not be had: build and export on this thread from now on, with
        the exporter the environment configures."""
        self._lost_to_span_process = self.sink.lost_events
        self.sink, self._calls = None, None
        self.use_env_exporter()

    def _builder_failed(self, exc: Exception) -> None:
        self.counters.builder_errors += 1
        if not self._builder_warned:
            self._builder_warned = True
            log.warning(
                "engine_hooks: building spans failed (%s: %s); counting and going on",
                type(exc).__name__,
                exc,
                exc_info=True,
            )

    def _send(self, final: bool, everything: bool) -> int:
        """Span-process mode: this round's events, as the tracker would be told them
        (:class:`~engine_hooks.span_process.parent.CallRecorder`), to the span process."""
        calls = self._calls
        events = self.recorder.drain()
        items = calls.translate(events, self.gpu_elapsed, force=final)
        http = calls.take_http()
        if items or http or final or everything:
            self.sink.deliver((items, http, final, everything), len(events))
        c = self.counters
        c.events_dropped = self.recorder.dropped + self.sink.lost_events
        return 0

    def deliver_round(self, final: bool = False, everything: bool = False) -> int:
        """What the tracker has finished, as spans, to the exporter (the round after the tracker
        was fed); returns the number of spans handed to the exporter."""
        self.tracker.resolve_gpu(force=final)
        if final:
            self.tracker.close_all(self.anchor.wall_ns(monotonic_ns()))
        self.tracker.release_aborted(None if everything else self.anchor.wall_ns(monotonic_ns()))
        finished, steps = self.tracker.take()
        preemptions = self.tracker.take_preemptions()
        speculations = self.tracker.speculation.take()
        t = self.tracker
        kv_accounts = t.kv_fetches.take() + t.kv_holds.take() + t.kv_transports.take()
        http = self.tracker.take_http()
        c = self.counters
        c.requests_traced += len(finished)
        c.steps_traced += len(steps)
        c.requests_evicted = self.tracker.evicted
        c.events_dropped = self.recorder.dropped + self._lost_to_span_process
        n = self.builder.build(finished, steps, preemptions, http, self.anchor.wall_ns, speculations, kv_accounts)
        c.requests_unsampled = self.factory.unsampled
        if self.exporter is not None:
            c.spans_exported = self.exporter.exported
            c.spans_dropped = self.exporter.dropped
        return n

    def _span_process_settings(self) -> dict:
        """What the span process builds the same spans with (:func:`engine_hooks.span_process.parent.serve`):
        this pipeline's settings, and its wall-clock anchor (its events' monotonic times are this
        host's, and the span process places them as this process would)."""
        f, t = self.factory, self.tracker
        return {
            "resource": dict(f.resource.attributes),
            "boundary": f.boundary,
            "engine": f.engine,
            "model": f.model,
            "detail": f.detail,
            "offset_ns": self.anchor.offset_ns,
            "max_in_flight": t.max_in_flight,
            "abort_grace_ns": t.abort_grace_ns,
            "interval_s": self.interval_s,
        }

    def _after_fork_in_child(self) -> None:
        """In a child made by ``fork()``: the span thread did not survive, the locks may be held by
        threads that do not exist here, and the parent's events and requests in flight are the
        parent's (it exports them). Start over with what the child records: fresh locks, recorder
        and tracker, a new thread if the parent's was running, and, for a pipeline configured from
        the environment, a fresh exporter (a gRPC channel does not survive a fork)."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.recorder.reset()  # in place: the hooks hold its record method
        self.anchor = WallAnchor()
        old = self.tracker
        self.tracker = RequestTracker(
            self.anchor, old.max_in_flight, gpu_elapsed=old.gpu_elapsed, abort_grace_ns=old.abort_grace_ns
        )
        self.counters = PipelineCounters()
        if self.sink is not None:  # the span process is the parent's: this process starts its own
            self.sink.forget_after_fork(self._span_process_settings())
            self.sink.counters = self.counters
            self._calls = CallRecorder(self.anchor)
        elif self._from_env:
            self.use_env_exporter()
        was_running = self._thread is not None
        self._thread = None
        if was_running and not self._stopped:
            self.start()

    def flush(self) -> None:
        """Export everything recorded so far (requests still in flight stay in flight; aborted ones
        do not wait out their grace); with a span process, until it has exported it (or its
        timeout, ``OTEL_BSP_EXPORT_TIMEOUT``)."""
        self.process(everything=True)
        if self.sink is not None:
            with self._lock:
                self.sink.flush()
        if self.exporter is not None:
            self.exporter.force_flush()

    def shutdown(self, deadline: float | None = None) -> None:
        """Final flush: requests still in flight are exported as incomplete, then the exporter
        closes (the span process exports what it holds and ends), all of it by ``deadline``
        (``time.monotonic()``; default: ``OTEL_LLM_EXIT_TIMEOUT`` from now). What is not sent
        by then is dropped and counted (:attr:`PipelineCounters.spans_dropped`)."""
        if self._stopped:
            return
        self._stopped = True
        if deadline is None:
            deadline = time.monotonic() + exit_timeout_s()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.sink is not None:
            self.sink.deadline = deadline  # the last round's write waits no longer
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return  # the pipeline's thread is still in a round at the deadline (a stuck write)
        try:
            t0 = time.thread_time_ns()
            self._process(final=True)
            self.counters.cpu_ns += time.thread_time_ns() - t0
            if self.sink is not None:
                self.sink.shutdown(deadline)
        finally:
            self._lock.release()
        exporter = self.exporter
        if isinstance(exporter, ExportQueue):
            exporter.close(deadline)
        elif exporter is not None:
            exporter.force_flush(max(0, int((deadline - time.monotonic()) * 1000)))
            exporter.shutdown()
        if exporter is not None:
            self.counters.spans_exported, self.counters.spans_dropped = exporter.exported, exporter.dropped


def exit_timeout_s() -> float:
    """``OTEL_LLM_EXIT_TIMEOUT`` in seconds: how long a traced process's exit may spend on its spans."""
    return environment.env_int(environment.EXIT_TIMEOUT, 5000, minimum=0) / 1000


_live_pipelines: weakref.WeakSet[TracingPipeline] = weakref.WeakSet()


@atexit.register
def _flush_all_at_exit() -> None:
    """Every pipeline's final round, span processes and exporters, then the tracer's own metrics,
    within one ``OTEL_LLM_EXIT_TIMEOUT``; what that dropped is said in one line."""
    t0 = time.monotonic()
    deadline = t0 + exit_timeout_s()
    pipelines = list(_live_pipelines)  # those stopped already (vLLM's scheduler stops its own) count too
    for p in pipelines:
        try:
            p.shutdown(deadline)
        except Exception:
            pass
    from .spans import self_metrics

    self_metrics.shutdown(deadline)  # the last values, after the final flush
    dropped = sum(p.counters.spans_dropped + p.counters.events_dropped for p in pipelines)
    killed = sum(p.sink.killed for p in pipelines if p.sink is not None)
    if dropped or killed:
        log.warning(
            "engine_hooks: exit after %.1f s (OTEL_LLM_EXIT_TIMEOUT=%d ms): %d spans exported, %d dropped, "
            "%d hook events dropped, %d span processes stopped unfinished, sending to %s",
            time.monotonic() - t0,
            round((deadline - t0) * 1000),
            sum(p.counters.spans_exported for p in pipelines),
            sum(p.counters.spans_dropped for p in pipelines),
            sum(p.counters.events_dropped for p in pipelines),
            killed,
            ", ".join(sorted({p.sends_to for p in pipelines})),
        )


def exporter_from_env_or_none() -> SpanExporter | None:
    """The exporter the environment configures; None (said once per call) for a setting that does
    not parse."""
    try:
        return exporter_from_env()
    except ValueError as exc:
        log.warning("engine_hooks: %s; spans are not exported", exc)
        return None


_defaults: dict[tuple, TracingPipeline] = {}
_default_lock = threading.Lock()


def default_pipeline(**kwargs) -> TracingPipeline:
    """The process's pipeline for these settings (``engine``, ``model``, ``service_name``, ...),
    configured from the environment on first use (exporter from ``OTEL_LLM_TRACES_FILE`` or the
    standard ``OTEL_*`` variables, run in a span process unless ``OTEL_LLM_SPAN_PROCESS=0``).
    The same settings give the same pipeline; other settings (a
    second engine in the process, say vLLM's front end and its engine core together) their own,
    never a pipeline silently set up for someone else."""
    key = tuple(sorted((k, v if isinstance(v, str | int | float | bool | None) else id(v)) for k, v in kwargs.items()))
    with _default_lock:
        p = _defaults.get(key)
        if p is None or p._stopped:
            try:
                kind = export_kind_from_env()  # None: spans go nowhere
            except ValueError as exc:
                log.warning("engine_hooks: %s; spans are not exported", exc)
                kind = None
            span_process = kind is not None and environment.env_bool(environment.SPAN_PROCESS, True)
            p = _defaults[key] = TracingPipeline(None, span_process=span_process, **kwargs)
            if kind is not None and not span_process:
                p.use_env_exporter()
            p._from_env = True
            p.start()
        return p


def _reinit_after_fork() -> None:
    """``os.register_at_fork(after_in_child=...)``: vLLM may start its engine-core process with
    fork (``VLLM_WORKER_MULTIPROC_METHOD=fork``); every pipeline the parent had starts over in
    the child, so the child's spans are exported by a thread that exists."""
    global _default_lock
    _default_lock = threading.Lock()
    for p in list(_live_pipelines):
        try:
            p._after_fork_in_child()
        except Exception as exc:  # never break the child
            log.warning("engine_hooks: restarting a pipeline after fork failed: %s", exc)


class _ForkMark:
    """What ``multiprocessing.util.register_after_fork`` holds (a weak reference) for this module."""


_FORK_MARK = _ForkMark()


def _flush_at_multiprocessing_exit(_mark) -> None:
    """A multiprocessing child made by fork ends with ``os._exit``: atexit does not run there, its
    finalizers do (registered after its start, since the child clears those it inherits)."""
    import multiprocessing.util

    multiprocessing.util.Finalize(None, _flush_all_at_exit, exitpriority=100)


if hasattr(os, "register_at_fork"):
    import multiprocessing.util

    os.register_at_fork(after_in_child=_reinit_after_fork)
    multiprocessing.util.register_after_fork(_FORK_MARK, _flush_at_multiprocessing_exit)


def flush() -> None:
    """Export what every pipeline of this process has recorded so far."""
    for p in list(_live_pipelines):
        p.flush()
