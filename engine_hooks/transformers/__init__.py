"""transformers continuous batching, traced on the generic hook API.

``engine_hooks.instrument(model)`` (a model with ``generate_batch`` / ``init_continuous_batching``)
or ``engine_hooks.instrument(manager)`` (a ``ContinuousBatchingManager``, streaming included) hooks
instances only: other models and managers in the process stay untouched. The spans are the vLLM
adapter's: ``llm.request`` with ``llm.frontend`` (``add_request`` -> the generation loop took it
into its scheduler), ``llm.queue`` (-> first scheduled), ``llm.prefill`` (-> first token, chunked
prefill included), ``llm.decode``, ``llm.preemption`` (the offloading manager's evictions: ``swap``
when the KV went to the CPU pool, ``recompute`` for a soft reset), ``llm.stream``, and one
``llm.engine.step`` per forward pass (batch size, prefill and decode tokens, KV usage, GPU time on
CUDA).

Where each comes from (transformers 5.x, ``generation/continuous_batching``):

* ``model.init_continuous_batching`` -> the manager it returns is hooked (``generate_batch`` and
  ``continuous_batching_context_manager`` go through it);
* ``manager.add_request`` -> arrival (the id it returns; a request it drops returns None and is not
  traced), prompt tokens; a request added inside an OpenTelemetry span joins that span's trace;
* ``manager._create_batch_processor`` (on the generation thread) -> its batch processor:
  ``scheduler.add_waiting_request`` (queued, or during ``offloading_manager.offload_requests`` a
  preemption), ``scheduler.schedule_batch`` (the step starts; requests scheduled for the first
  time or again after a preemption), ``inputs_and_outputs.prepare_batch_update`` (the step's
  requests by reference: each with a new token generated one, unpacked off the engine's thread),
  ``update_batch`` (the step ends), ``scheduler.finish_request`` (ok; ``length`` when it reached
  ``max_new_tokens``, else ``stop``), ``scheduler.clear_cancelled_requests`` (cancelled) and
  ``_handle_request_error`` (error, with the exception's type).

Each token is generated and handed out of the engine in the step that sampled it (what vLLM's
engine core hands its output processor), streaming or not.
"""

from __future__ import annotations

from typing import Any

from otel_llm.semconv import RequestStatus

from ..api import EngineHooks, hooked, mark_hooked
from ..hot_path.gpu_timer import CudaEventTimer
from ..spans.tracker import RequestTracker


def _traceparent() -> dict | None:
    """The caller's current span as a W3C carrier (None outside a span)."""
    from opentelemetry import propagate

    carrier: dict = {}
    propagate.inject(carrier)
    return carrier or None


class _Loop:
    """The adapter's view of one batch processor: which requests are running (scheduled and not
    since preempted) and what the last scheduled batch held."""

    __slots__ = ("batch", "decode", "offloading", "prefill", "running")

    def __init__(self):
        self.running: set[str] = set()
        self.offloading = False
        self.batch = 0
        self.prefill = 0
        self.decode = 0

    def scheduled(self, result) -> list[str]:
        """The ids newly running in this batch; the batch's sizes, kept for the step."""
        batch = result[0] if result else None
        if not batch:
            self.batch = self.prefill = self.decode = 0
            return []
        new, running = [], self.running
        prefill = decode = 0
        for fs in batch:
            st = fs.state
            rid = st.request_id
            if rid not in running:
                running.add(rid)
                new.append(rid)
            if st.generated_tokens:  # a request with an output so far: its query tokens decode
                decode += fs.query_length
            else:
                prefill += fs.query_length
        self.batch, self.prefill, self.decode = len(batch), prefill, decode
        return new


def _tokens_of_step(tracker: RequestTracker, mono_ns: int, payload: list) -> None:
    """One step's FutureRequestStates (by reference): a token generated and handed out for each
    that sampled one (runs on the span-building thread)."""
    t = tracker.anchor.wall_ns(mono_ns)
    rids = [fs.state.request_id for fs in payload if fs.has_new_token]
    tracker.emitted(rids, None, t, t)


def _kv_usage_of(cache: Any):
    """The KV cache's used fraction (0..1) as this transformers version tells it, or None where it
    does not: ``compute_free_capacity()`` (5.19 on), free blocks of ``num_blocks`` (5.17)."""
    free = getattr(cache, "compute_free_capacity", None)
    if free is not None:
        return lambda res, *a, **k: 1.0 - free()
    blocks, total = getattr(cache, "get_num_free_blocks", None), getattr(cache, "num_blocks", None)
    if blocks is not None and isinstance(total, int) and total > 0:
        return lambda res, *a, **k: 1.0 - blocks() / total
    return None


def instrument_batch_processor(bp: Any, hooks: EngineHooks) -> bool:
    """Hook one ContinuousBatchProcessor instance; returns False when it was hooked already."""
    if hooked(getattr(bp, "update_batch", None)):
        return False
    loop = _Loop()
    sch, io, off = bp.scheduler, bp.inputs_and_outputs, bp.offloading_manager
    queued = hooks.queued(request_id=lambda res, rid: rid)(lambda rid: None)
    preempted = hooks.preempt(request_id=lambda res, rid, mode: rid, mode=lambda res, rid, mode: mode)(
        lambda rid, mode: None
    )
    finished = hooks.finish(
        request_id=lambda res, rid, status, reason: rid,
        status=lambda res, rid, status, reason: status,
        reason=lambda res, rid, status, reason: reason,
    )(lambda rid, status, reason: None)

    add_waiting = sch.add_waiting_request

    def add_waiting_request(state, *a, **k):
        out = add_waiting(state, *a, **k)
        rid = state.request_id
        if loop.offloading:  # evicted and requeued: a preemption, not a new request
            loop.running.discard(rid)
            preempted(rid, "swap" if getattr(state, "is_cpu_offloaded", False) else "recompute")
        else:
            queued(rid)
        return out

    sch.add_waiting_request = mark_hooked(add_waiting_request)
    sch.schedule_batch = hooks.schedule(scheduled=lambda res, *a, **k: loop.scheduled(res))(sch.schedule_batch)
    io.prepare_batch_update = hooks.raw(payload=lambda res, *a, **k: res[0], expander=_tokens_of_step)(
        io.prepare_batch_update
    )
    bp.update_batch = hooks.step(
        batch_size=lambda res, *a, **k: loop.batch,
        prefill_tokens=lambda res, *a, **k: loop.prefill,
        decode_tokens=lambda res, *a, **k: loop.decode,
        kv_usage=_kv_usage_of(bp.cache),
    )(bp.update_batch)

    finish = sch.finish_request

    def finish_request(request_id, *a, **k):
        state = sch.active_requests.get(request_id)
        out = finish(request_id, *a, **k)
        if not loop.offloading:
            loop.running.discard(request_id)
            full = state is not None and state.max_new_tokens is not None
            finished(
                request_id,
                RequestStatus.OK,
                "length" if full and state.generated_len() >= state.max_new_tokens else "stop",
            )
        return out

    sch.finish_request = mark_hooked(finish_request)
    sch.clear_cancelled_requests = hooks.finish(
        request_id=lambda res, *a, **k: [s.request_id for s in res or ()], status=RequestStatus.CANCELLED
    )(sch.clear_cancelled_requests)
    handle_error = bp._handle_request_error

    def handle_request_error(error, state, *a, **k):
        finished(state.request_id, RequestStatus.ERROR, type(error).__name__)
        loop.running.discard(state.request_id)
        return handle_error(error, state, *a, **k)

    bp._handle_request_error = mark_hooked(handle_request_error)
    offload = off.offload_requests

    def offload_requests(*a, **k):
        loop.offloading = True
        try:
            return offload(*a, **k)
        finally:
            loop.offloading = False

    off.offload_requests = mark_hooked(offload_requests)
    return True


def instrument_manager(manager: Any, hooks: EngineHooks | None = None) -> Any:
    """Hook one ContinuousBatchingManager in place; returns it."""
    if hooked(getattr(manager, "add_request", None)):
        return manager
    model = getattr(manager, "model", None)
    if hooks is None:
        on_cuda = getattr(getattr(model, "device", None), "type", None) == "cuda"
        name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
        hooks = EngineHooks(
            engine="transformers",
            model=name,
            service_name="transformers",
            gpu_timer=CudaEventTimer.if_available() if on_cuda else None,
        )
    arrive = hooks.arrival(
        request_id=lambda res, rid, n: rid,
        input_tokens=lambda res, rid, n: n,
        trace_headers=lambda res, rid, n: _traceparent(),
    )(lambda rid, n: None)
    refused = hooks.finish(
        request_id=lambda res, rid: rid, status=RequestStatus.REJECTED, reason=lambda res, rid: "dropped"
    )(lambda rid: None)
    add = manager.add_request

    def add_request(input_ids, request_id=None, *a, **k):
        # the arrival is recorded before the request is queued: the generation thread may take it
        # into its scheduler before add_request returns. Without an id, the one add_request would
        # make (the same counter, under its lock)
        lock, counter = getattr(manager, "_request_lock", None), getattr(manager, "_request_counter", None)
        if request_id is None and lock is not None and type(counter) is int:
            with lock:
                request_id = f"req_{manager._request_counter}"
                manager._request_counter += 1
        if request_id is None:  # another version: traced after the fact
            out = add(input_ids, request_id, *a, **k)
            if out is not None:
                arrive(out, len(input_ids))
            return out
        arrive(request_id, len(input_ids))
        try:
            out = add(input_ids, request_id, *a, **k)
        except BaseException as exc:
            hooks._finish_failed(request_id, RequestStatus.REJECTED, exc)
            raise
        if out is None:  # not accepting requests (stopping): dropped with a warning
            refused(request_id)
        return out

    manager.add_request = mark_hooked(add_request)
    create = manager._create_batch_processor

    def create_batch_processor(*a, **k):
        bp = create(*a, **k)
        try:
            instrument_batch_processor(bp, hooks)
        except Exception as exc:  # tracing never breaks generation
            hooks.pipeline.hook_failed(exc)
        return bp

    manager._create_batch_processor = mark_hooked(create_batch_processor)
    manager._otel_llm_hooks = hooks
    return manager


def instrument_model(model: Any, hooks: EngineHooks | None = None) -> Any:
    """Hook a model's continuous batching: every manager it creates from now on (generate_batch,
    init_continuous_batching, the context manager); returns the model."""
    init = model.init_continuous_batching
    if hooked(init):
        return model

    def init_continuous_batching(*a, **k):
        return instrument_manager(init(*a, **k), hooks)

    model.init_continuous_batching = mark_hooked(init_continuous_batching)
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if cached is not None:
        instrument_manager(cached, hooks)
    return model


def is_transformers_target(target: Any) -> bool:
    """A transformers model with continuous batching, or its manager."""
    return hasattr(target, "init_continuous_batching") or (
        hasattr(target, "add_request") and hasattr(target, "_create_batch_processor")
    )


def instrument(target: Any, hooks: EngineHooks | None = None) -> Any:
    """Trace transformers continuous batching on ``target`` (a model or a manager), in place.
    ``hooks``: the :class:`EngineHooks` to record with (default: one for this engine, on the
    process's default pipeline)."""
    if hasattr(target, "init_continuous_batching"):
        return instrument_model(target, hooks)
    return instrument_manager(target, hooks)
