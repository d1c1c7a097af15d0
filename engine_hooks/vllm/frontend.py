"""vLLM front end: the engine boundary (arrival, outputs handed out, finish or abort).

Hooks one ``OutputProcessor`` instance (``LLMEngine`` and ``AsyncLLM`` both own one) with the
generic :class:`~engine_hooks.api.EngineHooks`:

* ``add_request`` -> arrival (internal request id, external id as ``llm.request.id``, arrival
  wall time, prompt tokens, the caller's W3C trace headers);
* ``process_outputs`` -> :meth:`EngineHooks.raw`: on the engine's thread, one pass in C over the
  step's ``EngineCoreOutput`` list (:class:`~engine_hooks.hot_path.batch_scan.BatchScanner`: request ids,
  token counts, the few outputs with events or a finish reason); made plain data at the next
  round (:func:`plain_outputs`) and unpacked in the span process (:func:`expand_outputs`) into
  token events, and into the engine core's
  own QUEUED / SCHEDULED / PREEMPTED events (recorded inside vLLM's scheduler, monotonic clock of
  this host) that give the front-end (arrival -> QUEUED), queue (QUEUED -> first SCHEDULED, what
  vLLM's own tracing reports as ``gen_ai.latency.time_in_queue``), prefill, decode and preemption
  spans;
* ``abort_requests`` -> finish with status ``cancelled``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from typing import Any

from otel_llm import semconv as sc
from otel_llm.semconv import RequestStatus

from ..api import EngineHooks, hooked, mark_hooked, plain_payload
from ..hot_path.batch_scan import BatchScanner
from ..spans.tracker import RequestTracker
from .disagg import leg_attributes

#: trace headers of the request being added on this task (AsyncLLM drops them unless vLLM's own
#: tracing is on, so the adapter captures them before that).
incoming_trace_headers: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "otel_llm_incoming_trace_headers", default=None
)

_STATUS = {
    0: RequestStatus.OK,
    1: RequestStatus.OK,
    2: RequestStatus.CANCELLED,
    3: RequestStatus.ERROR,
    4: RequestStatus.OK,
}  # FinishReason -> status
_REASON = {0: "stop", 1: "length", 2: "abort", 3: "error", 4: "repetition"}
_QUEUED, _SCHEDULED, _PREEMPTED = 1, 2, 3  # EngineCoreEventType
#: the engine core's account of a prompt (its PrefillStats, in plain_outputs' order)
_PREFILL_ATTRS = (
    sc.CACHE_READ_INPUT_TOKENS,
    sc.PREFILL_COMPUTED_TOKENS,
    sc.PREFILL_LOCAL_CACHED_TOKENS,
    sc.PREFILL_EXTERNAL_CACHED_TOKENS,
)


#: what most outputs of a step do not have (a FinishReason may be 0: set means not None)
RARE_FIELDS = ("events", "prefill_stats", "finish_reason")


def output_scanner(rare_fields: tuple[str, ...] = RARE_FIELDS) -> BatchScanner:
    """The C scan of a step's ``EngineCoreOutput`` list (:class:`BatchScanner`): ids, token
    counts, and the outputs with any of ``rare_fields`` set."""
    from vllm.v1.engine import EngineCoreOutput

    return BatchScanner(EngineCoreOutput, "request_id", "new_token_ids", rare_fields)


def plain_outputs(payload: tuple) -> tuple:
    """A ``process_outputs`` payload as plain data (in the engine's process, where its objects
    are): each rare output as ``(request id, the engine core's events as (type, monotonic s) or
    None, its prefill account (cached, computed, local cached, external cached tokens) or None,
    its finish reason as an int or None)``; a step without rare outputs is plain already."""
    rare = payload[3]
    if rare is None:
        return payload
    out = []
    for o in rare:
        evs = o.events
        ps = o.prefill_stats
        fr = o.finish_reason
        out.append(
            (
                o.request_id,
                [(int(e.type), e.timestamp) for e in evs] if evs else None,
                None
                if ps is None
                else (
                    ps.num_cached_tokens,
                    ps.num_computed_tokens,
                    ps.num_local_cached_tokens,
                    ps.num_external_cached_tokens,
                ),
                None if fr is None else int(fr),
            )
        )
    return payload[0], payload[1], payload[2], out


@plain_payload(plain_outputs)
def expand_outputs(tracker: RequestTracker, mono_ns: int, payload: tuple) -> None:
    """Unpack one ``process_outputs`` call (in the span process), made plain by
    :func:`plain_outputs`: ``payload`` is ``(engine core timestamp, request ids, token counts or
    None for one each, rare outputs or None)``, read on the engine's thread by
    :class:`BatchScanner` (vLLM extends an output's ``new_token_ids`` list in place when it merges
    streamed deltas for a slow consumer, so its length later is not the step's count).

    In the order the engine meant them: the engine core's events (queued, scheduled, preempted)
    and its account of the prompt, then the step's tokens (:meth:`RequestTracker.emitted`, the
    whole batch at once), then the requests that finished."""
    core_ts, ids, counts, rare = payload
    anchor = tracker.anchor
    out_ns = anchor.wall_ns(mono_ns)
    gen_ns = anchor.wall_ns_from_mono_s(core_ts) if core_ts else out_ns
    for rid, events, prefill, _ in rare or ():
        for kind, ts in events or ():
            t = anchor.wall_ns_from_mono_s(ts)
            if kind == _SCHEDULED:
                tracker.scheduled(rid, t)
            elif kind == _QUEUED:
                tracker.queued(rid, t)
            elif kind == _PREEMPTED:
                tracker.preempted(rid, t, "recompute")  # vLLM v1 preempts by recomputation only
        if prefill is not None:  # the engine core's account of the prompt: computed, or from a cache
            tracker.annotate(rid, dict(zip(_PREFILL_ATTRS, prefill)))
    tracker.emitted(ids, counts, gen_ns, out_ns)
    for rid, _, _, fr in rare or ():
        if fr is not None:
            tracker.finish(rid, out_ns, _STATUS.get(fr, RequestStatus.ERROR), _REASON.get(fr, str(fr)))


def instrument_output_processor(
    op: Any, hooks: EngineHooks, model: str | None, connector: Mapping[str, str] | None = None
) -> bool:
    """Hook one OutputProcessor instance; returns False when it was hooked already. ``connector``:
    the engine's KV connector (:func:`engine_hooks.vllm.disagg.engine_connector`), whose requests
    say which leg of a disaggregated request they are."""
    if hooked(getattr(op, "process_outputs", None)):
        return False
    cls = type(op)
    model_key, id_key, internal_key, choice_key = (
        sc.REQUEST_MODEL,
        sc.REQUEST_ID,
        sc.REQUEST_INTERNAL_ID,
        sc.REQUEST_CHOICE,
    )
    headers_var = incoming_trace_headers
    pd_leg = leg_attributes if connector else None

    def fields(res, self, request, prompt=None, parent_req=None, request_index=0, *a, **k):
        # once a request, on the engine's thread: the names bound above, the dict built at once
        rid = request.request_id
        ext = getattr(request, "external_req_id", None) or rid
        if model:
            attrs = {model_key: model, id_key: ext, internal_key: rid}
        else:
            attrs = {id_key: ext, internal_key: rid}
        if parent_req is not None:  # SamplingParams(n > 1): one child request per choice
            attrs[choice_key] = int(request_index)
        t = getattr(request, "arrival_time", None)
        ids = getattr(request, "prompt_token_ids", None)
        headers = headers_var.get() or getattr(request, "trace_headers", None)
        if pd_leg is not None:  # a P/D engine: which leg (vLLM reads the same extra_args key)
            extra = getattr(request.sampling_params, "extra_args", None)
            attrs.update(pd_leg(extra.get("kv_transfer_params") if extra else None, connector))
        return rid, int(t * 1e9) if t else None, len(ids) if ids is not None else None, headers, attrs

    # bound to the instance: engines built without instrument() in this process stay untouched
    op.add_request = hooks.arrival_fields(fields)(cls.add_request).__get__(op)
    scanner = output_scanner()
    c_scan, scan = scanner.c_scan or scanner.scan_python, scanner.scan_python
    last_ids = [None]  # the ids the last step's scan returned: a steady batch is the same list

    def step_payload(res, self, outputs, engine_core_timestamp=None, *a, **k):
        try:  # the C pass straight away (every step); anything it was not made for through Python
            ids, counts, rare = c_scan(outputs, last_ids[0])
        except (TypeError, AttributeError):
            ids, counts, rare = scan(outputs, last_ids[0])
        last_ids[0] = ids
        return engine_core_timestamp, ids, counts, rare

    op.process_outputs = hooks.raw(payload=step_payload, expander=expand_outputs)(cls.process_outputs).__get__(op)
    op.abort_requests = hooks.finish(
        request_id=lambda res, *a, **k: res or (),
        status=RequestStatus.CANCELLED,
        reason=lambda *a, **k: "abort",
    )(cls.abort_requests).__get__(op)
    return True


def capture_trace_headers(engine: Any) -> None:
    """Wrap ``AsyncLLM.add_request`` of one engine so the caller's trace headers reach the hooks."""
    add = getattr(engine, "add_request", None)
    import functools
    import inspect

    if add is None or hooked(add) or not inspect.iscoroutinefunction(add):
        return  # LLMEngine (sync) passes trace_headers through to the request already

    @functools.wraps(add)
    async def add_request(*args, **kwargs):
        token = incoming_trace_headers.set(kwargs.get("trace_headers"))
        try:
            return await add(*args, **kwargs)
        finally:
            incoming_trace_headers.reset(token)

    engine.add_request = mark_hooked(add_request)
