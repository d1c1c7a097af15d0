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
the request is recomputed), the parts it bounds stay unknown and the queue keeps their time.
The account leaves the engine when the request leaves the fetch (it is scheduled): well before
its ``llm.request`` span, which ends when the request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import walked_span as sp
from .engine_accounts import AccountIndex
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

    @classmethod
    def from_walked(cls, s: tuple) -> KvFetch | None:
        """None where its times are not ints in order within the span."""
        start, end = s[sp.START], s[sp.END]
        load, seen = s[sp.KV_LOAD_OFFSET], s[sp.KV_RECEIVED_OFFSET]
        if type(start) is not int or type(end) is not int or end < start:
            return None
        for v in (load, seen):
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
        client_of = {}
        if batch.pairs is not None:
            client_of = dict(zip(batch.pairs[1].tolist(), batch.pairs[0].tolist()))
        for i, f in found:
            scheduled = int(batch.first_scheduled_ns[i])
            q = batch.queue[i]
            if f.load_ns is None or f.received_ns is None or f.incomplete or scheduled == NO_NS or not np.isfinite(q):
                continue  # the queue keeps what it held: nothing is split by a guess
            transfer, ready = (f.received_ns - f.load_ns) / _NS, (scheduled - f.received_ns) / _NS
            for r in (i, client_of.get(i)):
                if r is not None:
                    batch.kv_transfer[r], batch.kv_ready[r] = transfer, ready
                    batch.kv_blocks[r] = -1 if f.blocks is None else f.blocks
                    batch.queue[r] = q - transfer - ready
