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

from .records import RecordBatch

NONE = "none"
STALL_CLASSES = ("delivery", "engine:preemption", "engine:other")


def largest_gaps(batch: RecordBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per record: its largest gap between token events (seconds; NaN with fewer than two events),
    the gap's position (0: between the first two events; -1: none) and how many gaps it has."""
    n = len(batch)
    itl_ns, owner = itl_samples(batch.event_offsets_ns, batch.event_start)
    counts = np.bincount(owner, minlength=n) if len(owner) else np.zeros(n, np.int64)
    gap = np.full(n, np.nan)
    pos = np.full(n, -1, np.int64)
    if len(itl_ns):
        order = np.lexsort((-itl_ns, owner))  # by record, largest gap first (the earliest of ties)
        first = np.searchsorted(owner[order], np.arange(n))
        has = counts > 0
        at = order[first[has]]
        gap[has] = itl_ns[at] / 1e9
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        pos[has] = at - starts[has]
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
