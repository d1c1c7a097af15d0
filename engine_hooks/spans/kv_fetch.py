"""The KV connector's accounts of a disaggregated request, as each engine's scheduler saw them: the
decode side's KV fetch, stage by stage, and the prefill side's hold of the blocks it computed.

A decode engine (vLLM with a KV connector, ``kv_transfer_params.do_remote_prefill``) does not
compute the prompt: its scheduler has the request's KV cache loaded from the prefill engine first.
:class:`KvFetchBook` keeps, for each such request, the moments its scheduler moved it between the
fetch's stages (vLLM's own: ``waiting_to_start``, ``in_progress``, ``completed_waiting``, then out
of the fetch when it is scheduled, finishes or is aborted), and the KV blocks the load asked for.
The account leaves as an ``llm.engine.kv_transfer`` span named by ``llm.request.internal_id``
(:meth:`SpanFactory.kv_spans`) once the request left the fetch; the collector splits the
decode engine's queue with it (collector/pipeline/kv_fetch.py).

A prefill engine (``kv_transfer_params.do_remote_decode``) finishes the request with its one token
and keeps its KV blocks for the decode engine to read: its connector says so when the request
finishes (vLLM: ``request_finished`` asks to delay freeing the blocks), and the scheduler frees
them once the connector's worker says the decode side has read them (or its timeout passed).
:class:`KvHoldBook` keeps those moments; the account leaves as ``llm.engine.kv_hold``
(:meth:`SpanFactory.kv_spans`), which the collector joins to the request's prefill leg.
"""

from __future__ import annotations

from dataclasses import dataclass

from .open_book import OpenBook

#: vLLM's names of the stages (vllm/v1/metrics/stats.py: KV_FETCH_*); None: out of the fetch
WAITING_TO_START, IN_PROGRESS, COMPLETED_WAITING = "waiting_to_start", "in_progress", "completed_waiting"


@dataclass
class KvFetchRecord:
    """One request's KV fetch; wall-clock ns, None where the stage was not seen."""

    request_id: str
    start_ns: int  # the scheduler took the request, its KV still remote (waiting to start the load)
    end_ns: int  # it left the fetch: scheduled, finished or aborted
    load_ns: int | None = None  # the load started (in progress)
    received_ns: int | None = None  # the scheduler saw the transfer complete (completed, waiting)
    blocks: int | None = None  # the KV blocks the load asked for
    incomplete: bool = False  # still in the fetch at shutdown, or evicted
    failed_ns: int | None = None  # the connector said its load failed (vLLM then fails or recomputes it)


@dataclass
class KvHoldRecord:
    """One request's KV blocks held for the decode side; wall-clock ns."""

    request_id: str
    start_ns: int  # the request finished, its blocks kept for the decode engine
    end_ns: int  # the blocks freed
    blocks: int | None = None  # the KV blocks the decode engine is to read
    incomplete: bool = False  # still held at shutdown, or evicted


class KvHoldBook(OpenBook[KvHoldRecord]):
    """The KV blocks held for decode engines, bounded like :class:`KvFetchBook`."""

    def held(self, wall_ns: int, request_id: str, blocks: int | None) -> None:
        """``request_id`` finished at ``wall_ns`` and its blocks are kept for the decode engine."""
        if request_id not in self._open:
            self.make_room()
            self._open[request_id] = KvHoldRecord(request_id, wall_ns, wall_ns, blocks)

    def freed(self, wall_ns: int, request_id: str) -> None:
        """The scheduler freed ``request_id``'s blocks (any request's: those not held are not here)."""
        rec = self._open.pop(request_id, None)
        if rec is not None:
            rec.end_ns = wall_ns
            self.done.append(rec)


@dataclass
class KvTransportRecord:
    """What the connector's transport said of one request's transfers (NIXL's telemetry per
    transfer handle, summed): ``end_ns`` when its worker saw the last one done, wall-clock ns;
    ``start_ns`` that less their transfer time."""

    request_id: str
    start_ns: int
    end_ns: int
    nbytes: int = 0  # bytes moved
    wire_ns: int = 0  # the transport's own time for them (NIXL: xferDuration)
    incomplete: bool = False  # a transfer still open at shutdown, or evicted
    handshake_ns: int | None = None  # its wait for the worker's handshake with a new peer (None: none)
    handshake_from: int | None = None  # while it waits: when it began


class KvTransportBook(OpenBook[KvTransportRecord]):
    """The transfers of requests in flight in this process's connector worker, bounded."""

    def _record(self, wall_ns: int, request_id: str) -> KvTransportRecord:
        rec = self._open.get(request_id)
        if rec is None:
            self.make_room()
            rec = self._open[request_id] = KvTransportRecord(request_id, wall_ns, wall_ns)
        return rec

    def handshake(self, wall_ns: int, request_id: str, done: bool) -> None:
        """``request_id`` began (``done`` False) or ended its wait for a handshake with its peer."""
        rec = self._record(wall_ns, request_id)
        if not done:
            rec.handshake_from = wall_ns
        elif rec.handshake_from is not None:
            rec.handshake_ns, rec.handshake_from = wall_ns - rec.handshake_from, None
            rec.end_ns = max(rec.end_ns, wall_ns)

    def transfer(self, wall_ns: int, request_id: str, nbytes: int, xfer_ns: int) -> None:
        """One of ``request_id``'s transfers done: ``nbytes`` moved in ``xfer_ns``."""
        rec = self._record(wall_ns, request_id)
        rec.nbytes += nbytes
        rec.wire_ns += xfer_ns
        rec.end_ns = wall_ns
        start = wall_ns - rec.wire_ns
        rec.start_ns = start if rec.handshake_ns is None else min(rec.start_ns, start)

    def finished(self, request_ids) -> None:
        """The worker has no transfer left for ``request_ids``: their accounts leave."""
        for rid in request_ids:
            rec = self._open.pop(rid, None)
            if rec is not None:
                self.done.append(rec)


class KvFetchBook(OpenBook[KvFetchRecord]):
    """The KV fetches in flight, bounded: beyond ``max_in_flight`` the oldest leaves, marked
    incomplete (``evicted`` counts them)."""

    def stage(self, wall_ns: int, request_id: str, stage: str | None, blocks: int | None = None) -> None:
        """The scheduler moved ``request_id`` to ``stage`` (None: out of the fetch) at ``wall_ns``."""
        rec = self._open.get(request_id)
        if stage is None:
            if rec is not None:
                rec.end_ns = wall_ns
                self.done.append(self._open.pop(request_id))
            return
        if rec is None:
            self.make_room()
            rec = self._open[request_id] = KvFetchRecord(request_id, wall_ns, wall_ns)
        if stage == IN_PROGRESS and rec.load_ns is None:
            rec.load_ns = wall_ns
            rec.blocks = blocks
        elif stage == COMPLETED_WAITING and rec.received_ns is None:
            rec.received_ns = wall_ns

    def failed(self, wall_ns: int, request_ids) -> None:
        """The connector said the loads of ``request_ids`` failed (those in a fetch here)."""
        for rid in request_ids:
            rec = self._open.get(rid)
            if rec is not None and rec.failed_ns is None:
                rec.failed_ns = wall_ns
