"""vLLM engine core: one ``llm.engine.step`` span per scheduler iteration, from inside the
engine-core process (loaded there by vLLM's ``vllm.general_plugins`` entry point).

Hooks the ``Scheduler`` class with the generic :class:`~engine_hooks.api.EngineHooks`:
``schedule`` starts an iteration, ``update_from_output`` ends it (iterations are matched by
their ``SchedulerOutput``, so overlapping iterations under async scheduling pair up correctly).
Per step, on the engine's thread: two clock reads, a handful of attribute reads and one
``list.count`` over the batch's scheduled-token counts (C). Decode tokens are those of the
requests given exactly one token this step (a one-token prefill chunk counts as decode) and of
those given drafts to verify (speculative decoding); prefill tokens are the rest. A step that
verified drafts also says how many, and how many were accepted
(:func:`~engine_hooks.vllm.spec_decode.step_speculation`); from ``phases`` on, a scheduler that
decodes speculatively accounts for each request's drafts (:mod:`engine_hooks.vllm.spec_decode`).
After the step: how many requests are left waiting and why (``_waiting``: the scheduler's own limits). Each preemption
(``_preempt_request``, before it frees the request's blocks): the KV cache's usage and the
request's computed tokens, as an ``llm.engine.preemption`` span (its request is traced in the
front end, whose ``llm.preemption`` span is the same preemption, by ``llm.request.internal_id``).
A decode engine of a disaggregated deployment (a KV connector): each request's KV fetch
(:mod:`engine_hooks.vllm.kv_fetch`), as an ``llm.engine.kv_transfer`` span.

What is hooked follows ``OTEL_LLM_DETAIL`` (read in this process, which inherits it): the step
hooks only at ``steps`` (the only level that sends step spans), the preemption hook from
``phases`` on, nothing at ``request``. Where ``instrument()`` turned vLLM's statistics on only for
the scheduler's events (``OTEL_LLM_STATS_FOR_TRACING=1``: the caller asked for none), the
scheduler makes no per-step ``SchedulerStats`` (:func:`events_only_stats`): nothing in the front
end reads them, and making, sending and decoding them every step cost more than all of the
hooks.
"""

from __future__ import annotations

import logging

from otel_llm import environment
from otel_llm.environment import Detail

from ..api import EngineHooks, hooked, mark_hooked
from ..hot_path.gpu_timer import CudaEventTimer
from .kv_fetch import hook_kv_fetch
from .kv_fetch import instrument_nixl_worker as _nixl_worker_with
from .spec_decode import hook_speculation, step_speculation

log = logging.getLogger("engine_hooks")


def _tokens(res, self, so, *a, **k) -> tuple[int, int]:
    """(prefill, decode) tokens of the step, from what the scheduler scheduled: a request given
    exactly one token is decoding, and so is one given drafts to verify (speculative decoding:
    its last token and its drafts, ``1 + k`` tokens, whatever the step then emits); the rest is
    prefill. In C builtins: no Python frame per request."""
    decode = list(so.num_scheduled_tokens.values()).count(1)
    spec = so.scheduled_spec_decode_tokens
    if spec:  # a request with drafts is never one given a single token
        decode += len(spec) + sum(map(len, spec.values()))
    return so.total_num_scheduled_tokens - decode, decode


def _kv_usage(res, self, *a, **k):
    return self.kv_cache_manager.usage


def _waiting(res, self, so, *a, **k) -> tuple[int, str | None]:
    """Requests left waiting after the step, and why, from the scheduler's own limits:
    ``max_num_seqs`` (the batch is full), ``token_budget`` (the step used every schedulable
    token), ``deferred`` (every waiting request is held back: a grammar to compile, remote KV to
    arrive, streamed input), ``kv_cache`` (room in the batch and the budget, but the cache is
    nearly full), else ``other``."""
    n = len(self.waiting) + len(getattr(self, "kv_holding_waiting", ()))
    if not n:
        return 0, None
    if len(self.running) >= self.max_num_running_reqs:
        return n, "max_num_seqs"
    if so.total_num_scheduled_tokens >= self.max_num_scheduled_tokens:
        return n, "token_budget"
    if len(getattr(self, "deferred_waiting", ())) >= n:
        return n, "deferred"
    return n, "kv_cache" if self.kv_cache_manager.usage >= 0.9 else "other"


def events_only_stats(scheduler_cls) -> bool:
    """The scheduler records its events (QUEUED, SCHEDULED, PREEMPTED: they ride on each request's
    outputs) but makes no per-step ``SchedulerStats``: ``make_stats`` returns None, as it does with
    statistics off. Returns False when already done."""
    make_stats = scheduler_cls.make_stats
    if hooked(make_stats):
        return False

    def no_stats(self, *a, **k):
        return None

    no_stats.__wrapped__ = make_stats
    scheduler_cls.make_stats = mark_hooked(no_stats)
    return True


def hook_each_scheduler(scheduler_cls, hooks: EngineHooks, hookers) -> bool:
    """Hook each scheduler as it is built, for what only its configuration says it does
    (speculative decoding, a KV connector): each of ``hookers`` gets the instance and wraps its
    methods there, or leaves it untouched. Returns False when already done."""
    init = scheduler_cls.__init__
    if hooked(init):
        return False

    def init_and_hook(self, *a, **k):
        init(self, *a, **k)
        for hook in hookers:
            try:
                if hook(self, hooks):
                    # the pipeline, and its span process, start with the scheduler, not with its
                    # first request: a span process takes a second or more to start, and the first
                    # requests' accounts came after their records were derived (left unknown)
                    hooks.pipeline.start()
            except Exception as exc:  # tracing never stops an engine from starting
                name, kind = hook.__name__, type(exc).__name__
                log.warning("engine_hooks: %s failed (%s: %s); that part is untraced", name, kind, exc)

    init_and_hook.__wrapped__ = init
    scheduler_cls.__init__ = mark_hooked(init_and_hook)
    return True


def process_hooks(detail: str | None = None) -> EngineHooks:
    """The hooks of vLLM's engine side in this process, from the environment: the same settings give
    the same pipeline (:func:`engine_hooks.pipeline.default_pipeline`), so the scheduler's and a
    connector worker's in one process share it."""
    detail = detail or environment.detail_level()
    return EngineHooks(
        engine="vllm",
        service_name="vllm",
        gpu_timer=CudaEventTimer.if_available() if detail == Detail.STEPS else None,
        detail=detail,
    )


def instrument_nixl_worker(detail: str | None = None) -> None:
    """Hook vLLM's NIXL connector worker in this process, once loaded, for its transfers' bytes and
    times (``llm.engine.kv_transport``; from the ``phases`` detail on)."""
    if (detail or environment.detail_level()) != Detail.REQUEST:
        _nixl_worker_with(lambda: process_hooks(detail))


def instrument_scheduler_class(scheduler_cls=None, hooks: EngineHooks | None = None, detail: str | None = None) -> bool:
    """Patch vLLM's Scheduler class in this process for ``detail`` (default ``OTEL_LLM_DETAIL``);
    returns False when already patched."""
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls
    if hooked(scheduler_cls.shutdown):
        return False
    detail = detail or (hooks.detail if hooks is not None else environment.detail_level())
    hooks = hooks or process_hooks(detail)
    if environment.env_bool(environment.STATS_FOR_TRACING):
        events_only_stats(scheduler_cls)
    if detail == Detail.STEPS:
        scheduler_cls.schedule = hooks.schedule(key=lambda res, *a, **k: id(res))(scheduler_cls.schedule)
        scheduler_cls.update_from_output = hooks.step(
            key=lambda res, self, so, *a, **k: id(so),
            batch_size=lambda res, self, so, *a, **k: len(so.num_scheduled_tokens),
            tokens=_tokens,
            preempted=lambda res, self, so, *a, **k: len(getattr(so, "preempted_req_ids", None) or ()),
            kv_usage=_kv_usage,
            waiting=_waiting,
            speculation=step_speculation,
        )(scheduler_cls.update_from_output)

    if detail != Detail.REQUEST:
        hook_each_scheduler(scheduler_cls, hooks, (hook_speculation, hook_kv_fetch))
    shutdown = scheduler_cls.shutdown

    def shutdown_and_flush(self, *a, **k):
        try:
            if hooks.has_pipeline:  # none was needed (no step, no preemption): none is made now
                hooks.pipeline.shutdown()
        except Exception as exc:
            log.warning("engine_hooks: flushing step spans at shutdown failed: %s", exc)
        return shutdown(self, *a, **k)

    scheduler_cls.shutdown = mark_hooked(shutdown_and_flush)
    # the moment it preempts: what it had, before freeing it (an llm.engine.preemption span)
    if detail != Detail.REQUEST and hasattr(scheduler_cls, "_preempt_request"):
        scheduler_cls._preempt_request = hooks.preempt(
            request_id=lambda res, self, request, *a, **k: request.request_id,
            mode="recompute",  # vLLM v1 preempts by recomputation only
            kv_usage=_kv_usage,
            recompute_tokens=lambda res, self, request, *a, **k: request.num_computed_tokens,
        )(scheduler_cls._preempt_request)
    return True
