"""Stalls: the client's largest gap between token events, and which layer it came from.

For a request seen at both boundaries, its stall is the largest gap between the client's token
events when that gap is over a threshold (seconds). The engine's own gap before the same token
tells where it came from: if the engine's gap is at least half the client's, the engine was late
(``engine:preemption`` when the request was preempted, ``engine:other`` otherwise: a batch-mate's
prefill, scheduling); if not, the engine handed the token out on time and the time was lost after
it (``delivery``: detokenizing, the API server, the network, the client). When the two boundaries
saw different numbers of gaps (chunks merged on the way), the engine's largest gap stands in.

One vectorised function serves ``otel-llm compare`` and the collector's stall counters.
"""

from __future__ import annotations

import numpy as np

from otel_llm.request_math import itl_samples

from .records import RecordBatch, RequestRecord
from .steps import StepBatch

NONE = "none"
STALL_CLASSES = ("delivery", "engine:preemption", "engine:other")
#: What ``engine:other`` becomes when the engine's steps are known (``otel-llm compare`` on a store
#: with steps): from the steps of the same engine process that overlap the engine's own gap.
ENGINE_DETAIL = ("engine:prefill", "engine:batch", "engine:idle")
ALL_CLASSES = ("delivery", "engine:preemption", *ENGINE_DETAIL, "engine:other")


def largest_gaps(batch: RecordBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per record: its largest gap between token events (seconds; NaN with fewer than two events),
    the gap's position (0: between the first two events; -1: none) and how many gaps it has."""
    n = len(batch)
    itl_ns, owner = itl_samples(batch.event_offsets_ns, batch.event_start)
    counts = np.bincount(owner, minlength=n) if len(owner) else np.zeros(n, np.int64)
    gap = np.full(n, np.nan)
    pos = np.full(n, -1, np.int64)
    if len(itl_ns):
        has = counts > 0
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        mx = np.maximum.reduceat(itl_ns, starts[has])  # each record's gaps are contiguous
        full = np.zeros(n, itl_ns.dtype)
        full[has] = mx
        hit = np.flatnonzero(itl_ns == full[owner])  # where a record's largest gap is
        first = hit[np.unique(owner[hit], return_index=True)[1]]  # the earliest, per record
        gap[has] = mx / 1e9
        pos[has] = first - starts[has]
    return gap, pos, counts


def classify_stalls(client: RecordBatch, engine: RecordBatch, threshold: float) -> tuple[list[str], np.ndarray]:
    """For aligned pairs (``client[i]`` and ``engine[i]`` are one request): each pair's stall class
    (``none`` or one of :data:`STALL_CLASSES`) and the client's largest gap (seconds; NaN: fewer
    than two token events)."""
    gap, pos, counts = largest_gaps(client)
    e_itl, e_owner = itl_samples(engine.event_offsets_ns, engine.event_start)
    e_counts = np.bincount(e_owner, minlength=len(engine)) if len(e_owner) else np.zeros(len(engine), np.int64)
    e_starts = np.concatenate([[0], np.cumsum(e_counts)[:-1]]).astype(np.int64)
    same = (e_counts == counts) & (pos >= 0)
    egap = np.nan_to_num(np.asarray(engine.itl_max, dtype=float), nan=0.0)
    if same.any():
        egap[same] = e_itl[e_starts[same] + pos[same]] / 1e9
    stalled = np.nan_to_num(gap, nan=0.0) > threshold
    engine_late = egap >= 0.5 * np.nan_to_num(gap, nan=0.0)
    preempted = np.asarray(engine.preemptions) > 0
    causes = np.where(
        ~stalled, NONE, np.where(engine_late, np.where(preempted, "engine:preemption", "engine:other"), "delivery")
    )
    return causes.tolist(), gap


def engine_gap(client: RequestRecord, engine: RequestRecord) -> tuple[int, int] | None:
    """The engine's own gap (Unix ns, engine clock) before the token where the client's largest
    gap ends: the same token when both saw as many gaps, else the engine's largest gap."""
    c = np.diff(np.asarray(client.event_offsets_ns, dtype=np.int64))
    e = np.asarray(engine.event_offsets_ns, dtype=np.int64)
    if len(e) < 2:
        return None
    eg = np.diff(e)
    i = int(np.argmax(c)) if len(c) == len(eg) and len(c) else int(np.argmax(eg))
    return engine.submit_ns + int(e[i]), engine.submit_ns + int(e[i + 1])


def refine_engine_stall(gap: tuple[int, int], steps: StepBatch, median_step_ns: float) -> str:
    """Why the engine was late over ``gap`` (engine clock), from its steps that overlap it:

    * ``engine:idle``: steps cover less than half of the gap (no step ran: the scheduler had
      nothing to run, or the host was busy with something else);
    * ``engine:prefill``: a step in the gap computed prompt tokens and took at least twice the
      median step (a batch-mate's prefill ran in the same step);
    * ``engine:batch``: the batch grew during the gap (more requests in a step than in the step
      before the gap);
    * ``engine:other``: none of these.
    """
    a, b = gap
    i0 = int(np.searchsorted(steps.end_ns, a, side="right"))
    i1 = int(np.searchsorted(steps.start_ns, b, side="left"))
    if i1 <= i0:
        return "engine:idle"
    st, en = steps.start_ns[i0:i1], steps.end_ns[i0:i1]
    covered = int(np.sum(np.minimum(en, b) - np.maximum(st, a)))
    if covered < 0.5 * (b - a):
        return "engine:idle"
    dur = en - st
    if np.any((steps.prefill_tokens[i0:i1] > 0) & (dur >= 2 * median_step_ns)):
        return "engine:prefill"
    before = steps.batch_size[i0 - 1] if i0 > 0 else steps.batch_size[i0]
    if steps.batch_size[i0:i1].max() > before:
        return "engine:batch"
    return "engine:other"
