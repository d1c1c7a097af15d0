"""A decode engine's KV fetches in vLLM's engine core (disaggregated prefill/decode).

vLLM's scheduler moves a request whose KV cache is remote (``do_remote_prefill``) through the
stages of its fetch with one method, ``Scheduler._set_kv_fetch_stage(request, stage)``: waiting to
start the load (when it takes the request), in progress (the load started: the request waits in
``WAITING_FOR_REMOTE_KVS``), completed and waiting (the connector's worker said the transfer is
done), and out of the fetch (``None``: scheduled, finished or aborted). :func:`hook_kv_fetch` wraps
that method on a scheduler built with a KV connector (one without it is not touched) with
:meth:`EngineHooks.raw`: on the engine's thread, the request id, the stage and, when the load
starts, the blocks it asked for; booked in the span process
(:class:`~engine_hooks.spans.kv_fetch.KvFetchBook`), whose accounts leave as
``llm.engine.kv_transfer`` spans. The scheduler calls it with ``None`` for every request it schedules
from its waiting queue: the book ignores those it never saw fetch.
"""

from __future__ import annotations

from ..api import EngineHooks, plain_already
from ..spans.kv_fetch import IN_PROGRESS
from ..spans.tracker import RequestTracker


def _blocks(request) -> int | None:
    """The KV blocks a decode request's load asks for (``remote_block_ids``: a list, or a list per
    KV cache group), None where it does not say."""
    params = getattr(request, "kv_transfer_params", None)
    ids = params.get("remote_block_ids") if isinstance(params, dict) else None
    if not isinstance(ids, list | tuple):
        return None
    return sum(len(g) if isinstance(g, list | tuple) else 1 for g in ids)


def _stage(res, request, stage, *a, **k) -> tuple:
    return request.request_id, stage, _blocks(request) if stage == IN_PROGRESS else None


@plain_already
def expand_kv_fetch(tracker: RequestTracker, mono_ns: int, payload: tuple) -> None:
    tracker.kv_fetches.stage(tracker.anchor.wall_ns(mono_ns), *payload)


def hook_kv_fetch(scheduler, hooks: EngineHooks) -> bool:
    """Book the KV fetches of one scheduler built with a KV connector (False: none, or a vLLM
    without the stage method: not touched)."""
    if getattr(scheduler, "connector", None) is None or not hasattr(scheduler, "_set_kv_fetch_stage"):
        return False
    scheduler._set_kv_fetch_stage = hooks.raw(_stage, expand_kv_fetch)(scheduler._set_kv_fetch_stage)
    return True
