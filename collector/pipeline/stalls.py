"""Stalls: the client's largest gap between token events, and the layer it came from.

For a request seen at both boundaries, its stall is the largest gap between the client's token
events when that gap is over its threshold, ``max(floor, factor * the median of the request's
other gaps)`` (seconds; defaults :data:`DEFAULT_FLOOR_S` and :data:`DEFAULT_FACTOR`). The gap is bounded by two
tokens; the layers before the client saw the same two tokens at other times, and the stall belongs
to the first layer where at least half of the gap already shows:

1. the engine core, from its own generation times (``stall_core_gap``; an engine that does not say
   when it generated, from its token events): ``engine:preemption`` when the request was
   preempted, else ``engine:other`` (``otel-llm compare`` refines it from the engine's steps);
2. the API server: the engine core had the token on time, but the engine handed it out late
   (vLLM's output processor: detokenizing, the API server's event loop) or the HTTP server wrote it
   late (``stall_server_gap``, needs the server span): ``api_server``;
3. after the server wrote it on time: ``network/client`` (the network, socket buffers, the client
   reading slowly). Without the server span, 2 and 3 cannot be told apart: ``delivery``.

When the two boundaries saw different numbers of gaps (chunks merged on the way), the engine's
largest gap stands in. One vectorised function serves ``otel-llm compare`` and the collector's
stall counters; :func:`stall_layers` computes the per-layer gaps where requests are derived.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from otel_llm.metrics.request_math import itl_samples

from .records import RecordBatch, RequestRecord
from .steps import StepBatch

NONE = "none"
UNKNOWN = "unknown"  # a stall that cannot be told: the gaps, or the engine's side of one, are not known


@dataclass(frozen=True)
class Cause:
    """One cause a stall can have: where half of the gap first shows, and what it holds
    (docs/metrics/breakdown.md's table, checked by a test). ``from_steps``: told apart from
    ``engine:other`` only with the engine's steps (``otel-llm compare`` on a store with steps, from
    the steps of the same engine process that overlap the engine's own gap); the collector's
    counters, which do not hold the steps while they derive, leave those out."""

    name: str
    shows: str
    holds: str
    from_steps: bool = False


#: Every stall cause, declared once, in the order the outputs list them. Adding one is an entry here
#: and its computation (:func:`classify_stalls`, or :func:`refine_engine_stall` for one from the steps).
CAUSES: tuple[Cause, ...] = (
    Cause(
        "network/client",
        "nowhere before the client: the server wrote both tokens on time",
        "the network, socket buffers, the client reading slowly",
    ),
    Cause(
        "api_server",
        "the engine handed the token out late though the core had it, or the HTTP server wrote it late",
        "detokenizing and vLLM's output processor, the API server's event loop busy with other work",
    ),
    Cause("delivery", "after the engine, without the HTTP server span to split it", "`api_server` + `network/client`"),
    Cause(
        "engine:preemption",
        "the engine core's generation times (`llm.token_generated.offsets_ns`; an engine without them: its "
        "token events), and the request was preempted",
        "recomputing the evicted request",
    ),
    Cause(
        "engine:prefill",
        "the core, and a step in the gap computed prompt tokens and took at least twice the median step",
        "a batch-mate's prefill",
        from_steps=True,
    ),
    Cause(
        "engine:rejected-drafts",
        "the core, and a step in the gap verified draft tokens, took at least twice the median step and "
        "accepted fewer than half of its drafts (speculative decoding)",
        "verifying drafts the target model rejected: the step cost more than the tokens it gave",
        from_steps=True,
    ),
    Cause("engine:batch", "the core, and the batch grew during the gap", "more requests sharing each step", True),
    Cause(
        "engine:idle",
        "the core, and steps cover less than half the gap",
        "no step ran: nothing scheduled, the host busy",
        from_steps=True,
    ),
    Cause("engine:other", "the core, none of the above (or the steps are not known: the collector's counters)", ""),
)
#: Every cause, and those the collector counts (without the engine's steps).
ALL_CLASSES: tuple[str, ...] = tuple(c.name for c in CAUSES)
STALL_CLASSES: tuple[str, ...] = tuple(c.name for c in CAUSES if not c.from_steps)
ENGINE_DETAIL: tuple[str, ...] = tuple(c.name for c in CAUSES if c.from_steps)
#: A gap is a stall over max(floor, factor * the median of the request's other gaps): the floor keeps a fast
#: stream's ordinary jitter out, the factor scales with the request's own pace.
DEFAULT_FLOOR_S = 0.1
DEFAULT_FACTOR = 4.0


def _gap_index(c_offs: np.ndarray, e_offs: np.ndarray) -> int | None:
    """Which engine event pair (j, j + 1) bounds the client's largest gap: the same tokens when
    both saw as many events, else the engine's largest gap; None with fewer than two events."""
    if len(c_offs) < 2 or len(e_offs) < 2:
        return None
    if len(c_offs) == len(e_offs):
        return int(np.argmax(np.diff(c_offs)))
    return int(np.argmax(np.diff(e_offs)))


_SEG = 44  # bits of a value inside a segment key (2^44 ns: 4.9 hours; tokens: 1.7e13)


def _segment_search(flat: np.ndarray, lens: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.searchsorted(segment_k, q, side="left")`` for both queries ``q`` of row ``k`` of
    ``queries`` (m, 2), all at once: ``flat`` is the concatenation of m ascending segments of
    lengths ``lens`` (each >= 1), keyed by ``k << 44 | value - the segment's first``. Returns the
    local indices (m, 2) and a mask of the rows whose values and queries all fit in 2^44 of their
    segment's first (a segment spread wider, from hostile input, is left unknown)."""
    m = len(lens)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    seg = np.repeat(np.arange(m, dtype=np.int64), lens)
    base = flat[starts]
    top = (1 << _SEG) - 1
    rel, qrel = flat - base[seg], queries - base[:, None]
    fits = (flat[starts + lens - 1] - base <= top) & (qrel.max(axis=1) <= top)
    keys = (seg << _SEG) | np.clip(rel, 0, top)
    q = (np.arange(m, dtype=np.int64)[:, None] << _SEG) | np.clip(qrel, 0, top)
    return np.searchsorted(keys, q, side="left") - starts[:, None], fits


def stall_layers(
    ci: np.ndarray,
    ei: np.ndarray,
    submit_ns: np.ndarray,
    event_start: np.ndarray,
    offsets_ns: np.ndarray,
    tokens: np.ndarray,
    generated: list,
    server_chunks: list,
) -> tuple[np.ndarray, np.ndarray]:
    """For each pair (client record ``ci[k]``, engine record ``ei[k]``): the engine core's and the
    HTTP server's gap (seconds) over the two tokens bounding the client's largest gap, on the
    client record's row (NaN where unknown). ``generated[e]``: (Unix ns, tokens or None) of the
    engine's generation events; ``server_chunks[e]``: Unix ns of the server's body chunks (sorted).
    A token event's generation is the generation event that produced its last token; its write is
    the first body chunk at or after the engine handed it out. The two tokens are the same on both
    sides when both saw as many events, else the engine's largest gap stands in. Vectorised over
    the pairs: the per-pair work is gathering each one's arrays into one."""
    n = len(submit_ns)
    core, server = np.full(n, np.nan), np.full(n, np.nan)
    if not len(ci):
        return core, server
    st = np.asarray(event_start, np.int64)
    counts = np.diff(st)
    pos = _gap_positions(offsets_ns, st, n)
    ci, ei = np.asarray(ci, np.int64), np.asarray(ei, np.int64)
    ok = (counts[ci] >= 2) & (counts[ei] >= 2)
    ci, ei = ci[ok], ei[ok]
    j = _engine_pair(pos, counts, ci, ei)
    ev = np.stack([st[ei] + j, st[ei] + j + 1], axis=1)  # the two, in the batch's event arrays
    el = ei.tolist()
    # the HTTP server: the first chunk at or after each of the two was handed out
    k = [i for i, e in enumerate(el) if server_chunks[e] is not None and len(server_chunks[e])]
    if k:
        k = np.array(k, np.int64)
        chunks = [server_chunks[e] for e in ei[k].tolist()]
        lens = np.fromiter(map(len, chunks), np.int64, len(chunks))
        flat = np.concatenate(chunks).astype(np.int64)
        s, fits = _segment_search(flat, lens, submit_ns[ei[k]][:, None] + offsets_ns[ev[k]])
        fine = fits & (s[:, 1] < lens)
        at = np.concatenate([[0], np.cumsum(lens)[:-1]])[fine]
        server[ci[k[fine]]] = (flat[at + s[fine, 1]] - flat[at + s[fine, 0]]) / 1e9
    # the engine core: the generation events that produced the two tokens
    rows, gts, gks = [], [], []
    for i, e in enumerate(el):
        g = generated[e]
        if g is None:
            continue
        gt, gk = g
        if gk is None:  # one generation per token event
            if len(gt) != counts[e]:
                continue
            gk = tokens[st[e] : st[e + 1]]
        elif len(gk) != len(gt):
            continue
        if len(gt):
            rows.append(i)
            gts.append(gt)
            gks.append(gk)
    if rows:
        r = np.array(rows, np.int64)
        lens = np.fromiter(map(len, gts), np.int64, len(gts))
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        cum = np.cumsum(np.clip(np.concatenate(gks).astype(np.int64), 0, None))
        cum -= np.repeat(np.concatenate([[0], cum[starts[1:] - 1]]), lens)  # each segment from 0
        tok_cum = np.cumsum(tokens, dtype=np.int64)
        first = st[ei[r]]
        before = np.where(first > 0, tok_cum[np.maximum(first - 1, 0)], 0)
        want = tok_cum[ev[r]] - before[:, None]  # tokens handed out by each of the two
        kk, fits = _segment_search(cum, lens, want)
        fine = fits & (kk[:, 1] < lens)
        flat = np.concatenate(gts).astype(np.int64)
        at = starts[fine]
        core[ci[r[fine]]] = (flat[at + kk[fine, 1]] - flat[at + kk[fine, 0]]) / 1e9
    return core, server


def _engine_pair(pos: np.ndarray, counts: np.ndarray, ci: np.ndarray, ei: np.ndarray) -> np.ndarray:
    """For pairs (client ``ci[k]``, engine ``ei[k]``), each with two events or more: the engine event
    pair (j, j + 1) that bounds the client's largest gap, as ``j``: the same tokens when both saw as
    many events, else the engine's own largest gap stands in."""
    return np.where(counts[ci] == counts[ei], pos[ci], pos[ei])


def gap_end_events(offsets_ns: np.ndarray, event_start: np.ndarray, pairs) -> np.ndarray:
    """Per record of a batch (``event_start``: n + 1 bounds): which of its token events ends its
    largest gap between token events (1: the second event; -1: fewer than two events). The engine
    record of a pair (``pairs``: client and engine indices, or None) takes the event that ends its
    client's largest gap, picked as :func:`stall_layers` picks it."""
    st = np.asarray(event_start, np.int64)
    counts = np.diff(st)
    pos = _gap_positions(offsets_ns, st, len(counts))
    end = np.where(pos >= 0, pos + 1, -1)
    if pairs is not None and len(pairs[0]):
        ci, ei = np.asarray(pairs[0], np.int64), np.asarray(pairs[1], np.int64)
        ok = (counts[ci] >= 2) & (counts[ei] >= 2)
        end[ei[ok]] = _engine_pair(pos, counts, ci[ok], ei[ok]) + 1
    return end


def _gap_positions(offsets_ns: np.ndarray, event_start: np.ndarray, n: int) -> np.ndarray:
    """Per record: where its largest gap between token events is (0: between the first two; the
    earliest of equal ones; -1 with fewer than two events)."""
    itl_ns, owner = itl_samples(offsets_ns, event_start)
    pos = np.full(n, -1, np.int64)
    if not len(itl_ns):
        return pos
    counts = np.bincount(owner, minlength=n)
    has = counts > 0
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    full = np.zeros(n, itl_ns.dtype)
    full[has] = np.maximum.reduceat(itl_ns, starts[has])  # each record's gaps are contiguous
    hit = np.flatnonzero(itl_ns == full[owner])
    first = hit[np.concatenate([[True], owner[hit][1:] != owner[hit][:-1]])]  # owners ascend: the first per record
    pos[owner[first]] = first - starts[owner[first]]
    return pos


def _gaps(offsets_ns: np.ndarray, event_start: np.ndarray, n: int):
    """:func:`largest_gaps` over raw event arrays (record ``i`` owns ``event_start[i]:event_start[i + 1]``)."""
    itl_ns, owner = itl_samples(offsets_ns, event_start)
    counts = np.bincount(owner, minlength=n) if len(owner) else np.zeros(n, np.int64)
    gap = np.full(n, np.nan)
    med = np.full(n, np.nan)
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
        srt = itl_ns[np.lexsort((itl_ns, owner))]  # each record's gaps, sorted, still contiguous
        rest = counts - 1  # the median of the others: the largest gap must not set its own bar
        m = rest > 0
        lo, hi = starts + (rest - 1) // 2, starts + rest // 2
        med[m] = (srt[lo[m]] + srt[hi[m]]) / 2e9
    return gap, pos, counts, med


def largest_gaps(batch: RecordBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per record: its largest gap between token events (seconds; NaN with fewer than two events),
    the gap's position (0: between the first two events; -1: none), how many gaps it has and the
    median of its other gaps (seconds; NaN with fewer than two gaps)."""
    return _gaps(batch.event_offsets_ns, batch.event_start, len(batch))


def stall_thresholds(median_gap: np.ndarray, floor: float, factor: float) -> np.ndarray:
    """Per request: the gap (seconds) over which it stalled, ``max(floor, factor * median gap)``."""
    return np.maximum(floor, factor * np.nan_to_num(median_gap, nan=0.0))


def classify_stalls(
    client: RecordBatch,
    engine: RecordBatch,
    floor: float = DEFAULT_FLOOR_S,
    factor: float = DEFAULT_FACTOR,
) -> tuple[list[str], np.ndarray]:
    """For aligned pairs (``client[i]`` and ``engine[i]`` are one request): each pair's stall class
    (``none`` or one of :data:`STALL_CLASSES`, or :data:`UNKNOWN`: the client's gaps are not known
    (its source gives the first chunk and the end only), or it stalled and the engine's side of the
    gap is not (vLLM's own span: no per-token times, no generation times)) and the client's largest
    gap (seconds; NaN: fewer than two token events)."""
    gap, pos, counts, med = largest_gaps(client)
    e_itl, e_owner = itl_samples(engine.event_offsets_ns, engine.event_start)
    e_counts = np.bincount(e_owner, minlength=len(engine)) if len(e_owner) else np.zeros(len(engine), np.int64)
    e_starts = np.concatenate([[0], np.cumsum(e_counts)[:-1]]).astype(np.int64)
    same = (e_counts == counts) & (pos >= 0)
    egap = np.nan_to_num(np.asarray(engine.itl_max, dtype=float), nan=0.0)
    if same.any():
        egap[same] = e_itl[e_starts[same] + pos[same]] / 1e9
    g = np.nan_to_num(gap, nan=0.0)
    half = 0.5 * g
    stalled = g > stall_thresholds(med, floor, factor)
    core = np.asarray(client.stall_core_gap, dtype=float)
    srv = np.asarray(client.stall_server_gap, dtype=float)
    has_core, has_srv = np.isfinite(core), np.isfinite(srv)
    engine_late = np.where(has_core, np.nan_to_num(core) >= half, egap >= half)
    # the core had it on time, the engine handed it out late (the front-end process), or the
    # server wrote it late
    api_late = (has_core & (egap >= half)) | (has_srv & (np.nan_to_num(srv) >= half))
    preempted = np.asarray(engine.preemptions) > 0
    after = np.where(api_late, "api_server", np.where(has_srv, "network/client", "delivery"))
    causes = np.where(
        ~stalled, NONE, np.where(engine_late, np.where(preempted, "engine:preemption", "engine:other"), after)
    )
    c_summ, e_summ = np.asarray(client.events_summarised, bool), np.asarray(engine.events_summarised, bool)
    causes = np.where(c_summ | (stalled & e_summ & ~has_core), UNKNOWN, causes)
    return causes.tolist(), np.where(c_summ, np.nan, gap)


def engine_gap(client: RequestRecord, engine: RequestRecord) -> tuple[int, int] | None:
    """The engine's own gap (Unix ns, engine clock) before the token where the client's largest
    gap ends (the pair :func:`_gap_index` picks)."""
    e = np.asarray(engine.event_offsets_ns, dtype=np.int64)
    j = _gap_index(np.asarray(client.event_offsets_ns, dtype=np.int64), e)
    if j is None:
        return None
    return engine.submit_ns + int(e[j]), engine.submit_ns + int(e[j + 1])


def refine_engine_stall(gap: tuple[int, int], steps: StepBatch, median_step_ns: float) -> str:
    """Why the engine was late over ``gap`` (engine clock), from its steps that overlap it:

    * ``engine:idle``: steps cover less than half of the gap (no step ran: the scheduler had
      nothing to run, or the host was busy with something else);
    * ``engine:prefill``: a step in the gap computed prompt tokens and took at least twice the
      median step (a batch-mate's prefill ran in the same step);
    * ``engine:rejected-drafts``: a step in the gap verified draft tokens, took at least twice the
      median step and accepted fewer than half of them (speculative decoding spent the step on
      drafts the target model rejected);
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
    drafts, accepted = steps.draft_tokens[i0:i1], steps.accepted_tokens[i0:i1]
    if np.any((drafts > 0) & (accepted >= 0) & (2 * accepted < drafts) & (dur >= 2 * median_step_ns)):
        return "engine:rejected-drafts"
    before = steps.batch_size[i0 - 1] if i0 > 0 else steps.batch_size[i0]
    if steps.batch_size[i0:i1].max() > before:
        return "engine:batch"
    return "engine:other"
