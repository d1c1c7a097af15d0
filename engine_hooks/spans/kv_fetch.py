"""The decode side of a disaggregated request: its KV fetch, stage by stage, as the engine's
scheduler saw it.

A decode engine (vLLM with a KV connector, ``kv_transfer_params.do_remote_prefill``) does not
compute the prompt: its scheduler has the request's KV cache loaded from the prefill engine first.
:class:`KvFetchBook` keeps, for each such request, the moments its scheduler moved it between the
fetch's stages (vLLM's own: ``waiting_to_start``, ``in_progress``, ``completed_waiting``, then out
of the fetch when it is scheduled, finishes or is aborted), and the KV blocks the load asked for.
The account leaves as an ``llm.engine.kv_transfer`` span named by ``llm.request.internal_id``
(:meth:`SpanFactory.kv_fetch_spans`) once the request left the fetch; the collector splits the
decode engine's queue with it (collector/pipeline/kv_fetch.py).
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

    def close_all(self, wall_ns: int) -> None:
        """Shutdown: every fetch still open leaves, marked incomplete."""
        for rec in self._open.values():
            rec.end_ns = max(rec.end_ns, wall_ns)
            rec.incomplete = True
            self.done.append(rec)
        self._open.clear()
