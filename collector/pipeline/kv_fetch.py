"""A decode engine's KV fetch of each disaggregated request, joined to its record: the decode
queue without the transfer.

A decode engine's scheduler takes a P/D request with its KV cache still on the prefill engine; it
starts the load, the connector moves the blocks, the scheduler learns at a step that the transfer
is done, and schedules the request at a later one. vLLM's ``llm.queue`` (QUEUED -> first
SCHEDULED) holds all of that. The engine core's account (``llm.engine.kv_transfer``, named by
``llm.request.internal_id``: engine_hooks/spans/kv_fetch.py) says when the load started and when
the transfer was seen complete; joined to the request's engine record
(:mod:`~collector.pipeline.engine_accounts`), it splits that queue into three TTFT parts, which
still sum to it exactly (docs/metrics/disaggregated.md):

* ``queue``: queued -> the load started (waiting for the scheduler to start it);
* ``kv_transfer``: the load started -> the scheduler saw the transfer complete;
* ``kv_ready``: that step -> first scheduled (the engine's own SCHEDULED event, which ends the queue).

Where a moment is missing (a fetch that never started a load: the connector had nothing to load,
the request is recomputed), the parts it bounds stay unknown and the queue keeps their time; so
too for a load the connector said failed (``kv_load`` says which it was).
The account leaves the engine when the request leaves the fetch (it is scheduled): well before
its ``llm.request`` span, which ends when the request finishes.

The prefill engine's account of the same request (``llm.engine.kv_hold``, named by its own
internal id) says how long it held the request's KV blocks for the decode engine: from its finish
to the blocks freed. It joins the prefill leg: the decode record that took it in
(``prefill_request_id``) and its client's, or a prefill leg left on its own. It leaves the prefill
engine once the decode side has read the blocks, before the decode leg ends; where it comes after
the record was derived, ``prefill_kv_hold`` is unknown.

The decode engine's connector worker's account (``llm.engine.kv_transport``, named by the same
internal id as the fetch; from the worker's process, which may be another than the scheduler's)
says what its transport moved for the request and in how long (NIXL's telemetry): ``kv_bytes`` and
``kv_wire``, and its wait for the worker's handshake with a new peer, ``kv_handshake``: inside
``kv_transfer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from otel_llm.semconv import Boundary, PdRole

from . import walked_span as sp
from .engine_accounts import AccountIndex, with_clients
from .records import NO_NS, RecordBatch

_NS = 1e9


@dataclass(frozen=True)
class KvFetch:
    """One request's KV fetch: when the load started and when the scheduler saw the transfer
    complete (Unix ns, the engine core's clock; None where not seen), when it left the fetch, and
    the blocks the load asked for."""

    load_ns: int | None
    received_ns: int | None
    end_ns: int
    blocks: int | None
    incomplete: bool
    failed_ns: int | None = None  # the connector said the load failed

    @property
    def load(self) -> str:
        """What became of the load (the ``kv_load`` column): failed, loaded (seen complete), or none
        (none started: nothing to load, the prompt recomputed); unknown (None) for an account cut
        short (shutdown, evicted) before it said."""
        if self.failed_ns is not None:
            return "failed"
        if self.received_ns is not None:
            return "loaded"
        return None if self.incomplete or self.load_ns is not None else "none"

    @classmethod
    def from_walked(cls, s: tuple) -> KvFetch | None:
        """None where its times are not ints in order within the span."""
        start, end = s[sp.START], s[sp.END]
        load, seen, failed = s[sp.KV_LOAD_OFFSET], s[sp.KV_RECEIVED_OFFSET], s[sp.KV_FAILED_OFFSET]
        if type(start) is not int or type(end) is not int or end < start:
            return None
        for v in (load, seen, failed):
            if v is not None and (type(v) is not int or not 0 <= v <= end - start):
                return None
        if load is not None and seen is not None and seen < load:
            return None
        blocks = s[sp.KV_BLOCKS]
        return cls(
            None if load is None else start + load,
            None if seen is None else start + seen,
            end,
            blocks if type(blocks) is int and 0 <= blocks < 2**40 else None,
            s[sp.KV_INCOMPLETE] is True,
            None if failed is None else start + failed,
        )


class KvFetchIndex(AccountIndex):
    """KV fetch accounts by internal id (:class:`~collector.pipeline.engine_accounts.AccountIndex`)."""

    kind, code = "kv_fetch", sp.KV_FETCH

    def read(self, span: tuple) -> KvFetch | None:
        return KvFetch.from_walked(span)

    def fill(self, batch: RecordBatch, found: list[tuple[int, KvFetch]]) -> None:
        """The decode engine's record (and its client's, which copies the engine's parts) gets
        ``kv_transfer`` (load started -> seen complete, one clock), ``kv_ready`` (seen complete ->
        first scheduled, the engine's own SCHEDULED event) and ``kv_blocks``; its ``queue`` gives
        up their time and keeps queued -> load started."""
        for rows, f in with_clients(batch, found):
            i = rows[0]
            for r in rows:
                batch.kv_load[r] = f.load
            scheduled = int(batch.first_scheduled_ns[i])
            q = batch.queue[i]
            if f.load_ns is None or f.received_ns is None or f.incomplete or scheduled == NO_NS or not np.isfinite(q):
                continue  # the queue keeps what it held: nothing is split by a guess
            if f.failed_ns is not None:  # a load that failed (then recomputed): no transfer to show
                continue
            transfer, ready = (f.received_ns - f.load_ns) / _NS, (scheduled - f.received_ns) / _NS
            for r in rows:
                batch.kv_transfer[r], batch.kv_ready[r] = transfer, ready
                batch.kv_blocks[r] = -1 if f.blocks is None else f.blocks
                batch.queue[r] = q - transfer - ready


@dataclass(frozen=True)
class KvHold:
    """One request's KV blocks held by its prefill engine: finished -> freed (ns, its clock)."""

    start_ns: int
    end_ns: int
    incomplete: bool

    @classmethod
    def from_walked(cls, s: tuple) -> KvHold | None:
        start, end = s[sp.START], s[sp.END]
        if type(start) is not int or type(end) is not int or end < start:
            return None
        return cls(start, end, s[sp.KV_INCOMPLETE] is True)


class KvHoldIndex(AccountIndex):
    """KV hold accounts by the prefill engine's internal id."""

    kind, code = "kv_hold", sp.KV_HOLD

    def keys(self, batch: RecordBatch) -> list:
        """An engine record's: a joined one's prefill leg's id, a prefill leg alone its own (its
        client's record names the same leg, and takes the hold from its engine record's)."""
        return [
            None if b != Boundary.ENGINE else p if p else (i if role == PdRole.PREFILL else None)
            for b, p, i, role in zip(batch.boundary, batch.prefill_request_id, batch.internal_id, batch.pd_role)
        ]

    def read(self, span: tuple) -> KvHold | None:
        return KvHold.from_walked(span)

    def fill(self, batch: RecordBatch, found: list[tuple[int, KvHold]]) -> None:
        """``prefill_kv_hold`` on the record and on its client's; unknown where the hold did not end
        (the engine shut down first, or its book was full)."""
        for rows, h in with_clients(batch, found):
            if not h.incomplete:
                batch.prefill_kv_hold[rows] = (h.end_ns - h.start_ns) / _NS


@dataclass(frozen=True)
class KvTransport:
    """What the transport moved for one request, and its own time for it (ns)."""

    nbytes: int
    wire_ns: int
    handshake_ns: int | None = None  # its wait for a handshake with a new peer

    @classmethod
    def from_walked(cls, s: tuple) -> KvTransport | None:
        start, end, nbytes, wire = s[sp.START], s[sp.END], s[sp.KV_BYTES], s[sp.KV_WIRE]
        if type(start) is not int or type(end) is not int or end < start or s[sp.KV_INCOMPLETE] is True:
            return None
        if type(nbytes) is not int or not 0 <= nbytes < 2**50 or type(wire) is not int or not 0 <= wire <= end - start:
            return None
        hs = s[sp.KV_HANDSHAKE]
        if hs is not None and (type(hs) is not int or not 0 <= hs <= end - start):
            return None
        return cls(nbytes, wire, hs)


class KvTransportIndex(AccountIndex):
    """KV transport accounts by the decode engine's internal id."""

    kind, code = "kv_transport", sp.KV_TRANSPORT

    def read(self, span: tuple) -> KvTransport | None:
        return KvTransport.from_walked(span)

    def fill(self, batch: RecordBatch, found: list[tuple[int, KvTransport]]) -> None:
        """``kv_bytes`` and ``kv_wire`` on the record and on its client's."""
        for rows, t in with_clients(batch, found):
            batch.kv_bytes[rows], batch.kv_wire[rows] = t.nbytes, t.wire_ns / _NS
            if t.handshake_ns is not None:
                batch.kv_handshake[rows] = t.handshake_ns / _NS
