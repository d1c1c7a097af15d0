"""A decode engine's KV fetches and a prefill engine's KV holds in vLLM's engine core
(disaggregated prefill/decode).

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

A load that fails (the connector's worker reports it: a handshake or a transfer that failed) reaches
the scheduler as ``Scheduler._handle_failed_recving(request_ids)``, also hooked: the fetch says when
(vLLM then fails the request or recomputes its prompt, by its ``kv_load_failure_policy``).

On the prefill side, the scheduler asks its connector, as a request finishes, whether to keep its
blocks for the decode engine (``Scheduler._connector_finished(request)`` -> ``(delay_free,
kv_transfer_params)``), and frees them later with ``Scheduler._free_blocks(request)``, once the
connector's worker says they were read (or its timeout passed). The same hook wraps both: the hold,
from the finish to the blocks freed, booked in :class:`~engine_hooks.spans.kv_fetch.KvHoldBook`,
leaves as ``llm.engine.kv_hold``.

What the transfer itself took, NIXL says per transfer handle (``nixl_agent.get_xfer_telemetry``:
bytes, the transfer's duration in microseconds), and vLLM's connector worker reads
it as each of a request's handles completes (``_pop_done_transfers``) into interval aggregates
without the request. :func:`hook_nixl_telemetry` maps handle to request there and books each
request's bytes and NIXL's own transfer time (:class:`~engine_hooks.spans.kv_fetch.KvTransportBook`),
which leave as ``llm.engine.kv_transport`` once the worker has no transfer left for the request;
a request whose peer is new waits for the worker's handshake with it first
(``_background_nixl_handshake``, a future completed on the handshake's thread), booked too.
The worker runs in a process of its own (vLLM's multiprocess executor) or in the engine core's:
:func:`instrument_nixl_worker` hooks its class in whichever process imports it, with that
process's hooks.
"""

from __future__ import annotations

from ..after_import import after_import
from ..api import EngineHooks, hooked, mark_hooked, plain_already
from ..spans.kv_fetch import IN_PROGRESS
from ..spans.tracker import RequestTracker


def _blocks(params) -> int | None:
    """The KV blocks ``kv_transfer_params`` name (``remote_block_ids``: a list, or a list per KV
    cache group): those a decode request's load asks for, or those a prefill engine keeps for it;
    None where they do not say."""
    ids = params.get("remote_block_ids") if isinstance(params, dict) else None
    if not isinstance(ids, list | tuple):
        return None
    return sum(len(g) if isinstance(g, list | tuple) else 1 for g in ids)


def _stage(res, request, stage, *a, **k) -> tuple:
    return (
        request.request_id,
        stage,
        _blocks(getattr(request, "kv_transfer_params", None)) if stage == IN_PROGRESS else None,
    )


def _failed(res, failed_req_ids, *a, **k) -> tuple:
    return tuple(failed_req_ids)


@plain_already
def expand_kv_failed(tracker: RequestTracker, mono_ns: int, request_ids: tuple) -> None:
    tracker.kv_fetches.failed(tracker.anchor.wall_ns(mono_ns), request_ids)


def _held(res, request, *a, **k) -> tuple | None:
    """A request whose blocks its connector keeps for the decode side: its id and the blocks."""
    if type(res) is tuple and len(res) == 2 and res[0] is True:
        return request.request_id, _blocks(res[1])
    return None


def _freed(res, request, *a, **k) -> str:
    return request.request_id


@plain_already
def expand_kv_fetch(tracker: RequestTracker, mono_ns: int, payload: tuple) -> None:
    tracker.kv_fetches.stage(tracker.anchor.wall_ns(mono_ns), *payload)


@plain_already
def expand_kv_held(tracker: RequestTracker, mono_ns: int, payload: tuple | None) -> None:
    if payload is not None:
        tracker.kv_holds.held(tracker.anchor.wall_ns(mono_ns), *payload)


@plain_already
def expand_kv_freed(tracker: RequestTracker, mono_ns: int, request_id: str) -> None:
    if len(tracker.kv_holds):
        tracker.kv_holds.freed(tracker.anchor.wall_ns(mono_ns), request_id)


#: vLLM's NIXL connector worker (imported by vLLM where the engine has one; never imported here)
NIXL_WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"


def _said(res, said: tuple, done) -> tuple:
    return said, tuple(done)


def _tell(said: tuple, done) -> None:
    return None


@plain_already
def expand_kv_transport(tracker: RequestTracker, mono_ns: int, payload: tuple) -> None:
    said, done = payload
    wall = tracker.anchor.wall_ns(mono_ns)
    for request_id, nbytes, xfer_us in said:
        if request_id is not None:
            tracker.kv_transports.transfer(wall, request_id, nbytes, xfer_us * 1000)
    tracker.kv_transports.finished(done)


def hook_nixl_telemetry(hooks: EngineHooks, worker_cls) -> bool:
    """Book NIXL's telemetry of each completed transfer handle by its request, in ``worker_cls``
    (vLLM's ``NixlBaseConnectorWorker``). False: not that class, or done already."""
    pop = getattr(worker_cls, "_pop_done_transfers", None)
    if pop is None or hooked(pop):
        return False
    tell = hooks.raw(_said, expand_kv_transport)(_tell)

    def telemetry_kept(worker) -> dict | None:
        """The worker's agent's telemetry reader, wrapped once to keep what it read by handle."""
        kept = worker.__dict__.get("_otel_llm_telemetry")
        if kept is None:
            agent = getattr(worker, "nixl_wrapper", None)
            read = getattr(agent, "get_xfer_telemetry", None)
            if read is None:
                return None
            kept = worker._otel_llm_telemetry = {}

            def get_xfer_telemetry(handle):
                res = read(handle)
                try:
                    if len(kept) > 65536:  # read where no pop of ours drains it: bounded all the same
                        kept.clear()
                    kept[handle] = (int(res.totalBytes), int(res.xferDuration))
                except Exception:  # another NIXL's telemetry: no bytes said
                    pass
                return res

            agent.get_xfer_telemetry = get_xfer_telemetry
        return kept

    def pop_done_transfers(self, transfers, *a, **k):
        if not transfers:  # every step: nothing in flight, nothing to say
            return pop(self, transfers, *a, **k)
        kept = of = None
        try:  # which request each handle in flight belongs to, before they are popped
            kept = telemetry_kept(self)
            if kept is not None:
                of = {h: rid for rid, handles in transfers.items() for h in handles}
        except Exception as exc:  # tracing never breaks the engine
            hooks._hook_failed(exc)
        res = pop(self, transfers, *a, **k)
        if kept:
            try:
                said = tuple((of.get(h), *t) for h, t in kept.items())
                kept.clear()
                tell(said, res[0] if type(res) is tuple and res else ())
            except Exception as exc:
                hooks._hook_failed(exc)
        return res

    worker_cls._pop_done_transfers = mark_hooked(pop_done_transfers)
    handshake = getattr(worker_cls, "_background_nixl_handshake", None)
    if handshake is not None and not hooked(handshake):
        began = hooks.raw(_handshake_began, expand_kv_handshake)(_tell_handshake)
        ended = hooks.raw(_handshake_ended, expand_kv_handshake)(_tell_handshake)

        def background_nixl_handshake(self, req_id, remote_engine_id, *a, **k):
            res = handshake(self, req_id, remote_engine_id, *a, **k)
            try:  # the handshake this request waits for, if one is under way (else it was ready)
                fut = getattr(self, "_handshake_futures", {}).get(remote_engine_id)
                if fut is not None and not fut.done():
                    began(req_id)
                    fut.add_done_callback(lambda f, rid=req_id: ended(rid))  # on the handshake's thread
            except Exception as exc:
                hooks._hook_failed(exc)
            return res

        worker_cls._background_nixl_handshake = mark_hooked(background_nixl_handshake)
    return True


def _tell_handshake(request_id: str) -> None:
    return None


def _handshake_began(res, request_id: str) -> tuple:
    return request_id, False


def _handshake_ended(res, request_id: str) -> tuple:
    return request_id, True


@plain_already
def expand_kv_handshake(tracker: RequestTracker, mono_ns: int, payload: tuple) -> None:
    tracker.kv_transports.handshake(tracker.anchor.wall_ns(mono_ns), *payload)


def instrument_nixl_worker(hooks_for) -> None:
    """Hook vLLM's NIXL connector worker in this process once it is imported (vLLM imports it where
    an engine's worker has a NIXL connector; never imported here), with ``hooks_for()``'s hooks."""

    def then(module) -> None:
        cls = getattr(module, "NixlBaseConnectorWorker", None)
        if cls is not None:
            hooks = hooks_for()
            if hook_nixl_telemetry(hooks, cls):
                hooks.pipeline.start()  # its spans leave on the pipeline's schedule from now on

    after_import(NIXL_WORKER_MODULE, then)


def hook_kv_fetch(scheduler, hooks: EngineHooks) -> bool:
    """Book the KV fetches and the KV holds of one scheduler built with a KV connector (False:
    none, or a vLLM without the stage method: not touched; the holds where its methods are there)."""
    if getattr(scheduler, "connector", None) is None or not hasattr(scheduler, "_set_kv_fetch_stage"):
        return False
    scheduler._set_kv_fetch_stage = hooks.raw(_stage, expand_kv_fetch)(scheduler._set_kv_fetch_stage)
    if hasattr(scheduler, "_handle_failed_recving"):  # the connector's failed loads, at a step
        scheduler._handle_failed_recving = hooks.raw(_failed, expand_kv_failed)(scheduler._handle_failed_recving)
    if hasattr(scheduler, "_connector_finished") and hasattr(scheduler, "_free_blocks"):
        scheduler._connector_finished = hooks.raw(_held, expand_kv_held)(scheduler._connector_finished)
        scheduler._free_blocks = hooks.raw(_freed, expand_kv_freed)(scheduler._free_blocks)
    return True
