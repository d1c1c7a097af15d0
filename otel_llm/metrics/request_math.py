"""Per-request metric math of docs/metrics/spec.md, vectorised over a :class:`TimelineBatch`.

Every function is pure. Inputs and outputs are in **seconds** (TPOT: seconds per token).
Undefined values are ``NaN`` (never 0): TTFT when a request has no token event, TPOT when it has
``N <= 1`` output tokens, the largest ITL when it has fewer than two token events.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .timeline import Timeline, TimelineBatch


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request values, one entry per request of the batch (seconds)."""

    ttft: np.ndarray  # t_1 - submit; NaN when m == 0
    tpot: np.ndarray  # (t_m - t_1) / (N - 1); NaN when N <= 1
    e2e: np.ndarray  # end - submit
    itl_max: np.ndarray  # largest ITL sample; NaN when m < 2
    events: np.ndarray  # m, token events (int)
    output_tokens: np.ndarray  # N = sum k_i (int); -1 where the source does not say (tokens_unknown)
    multi_token_events: np.ndarray  # events carrying more than one token (int)
    itl: np.ndarray  # pooled ITL samples of all requests, request order (seconds)
    itl_request: np.ndarray  # index of the request each ITL sample belongs to
    # requests whose source gives their first and last token only (TimelineBatch.summarised): their
    # largest ITL is unknown, not vacuous; None: none
    itl_unknown: np.ndarray | None = None


def segment_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum of ``values[offsets[i]:offsets[i+1]]`` for each i; empty segments give 0."""
    csum = np.zeros(len(values) + 1, dtype=np.result_type(values.dtype, np.int64))
    np.cumsum(values, out=csum[1:])
    return csum[offsets[1:]] - csum[offsets[:-1]]


def itl_samples(event_times: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ITL samples (docs/metrics/spec.md): each gap between consecutive token events of one request,
    in request order, and the request each belongs to. Request ``i`` owns
    ``event_times[offsets[i]:offsets[i + 1]]`` (ascending). The gaps keep the times' unit and dtype:
    float seconds, or int64 ns, exactly, when given ns."""
    counts = np.diff(offsets)
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    if len(event_times) < 2:
        return event_times[:0], owner[:0]
    same = owner[1:] == owner[:-1]  # drop the gaps that cross requests
    return np.diff(event_times)[same], owner[1:][same]


def _largest_gap(itl: np.ndarray, events: np.ndarray) -> np.ndarray:
    """Each request's largest ITL sample (NaN with fewer than two events): a request's samples are
    contiguous, so one reduceat over the start of each run."""
    n_req = len(events)
    out = np.full(n_req, np.nan)
    if len(itl):
        gap_counts = np.maximum(events - 1, 0)
        nz = gap_counts > 0
        gstart = np.zeros(n_req, np.int64)
        np.cumsum(gap_counts[:-1], out=gstart[1:])
        out[nz] = np.maximum.reduceat(itl, gstart[nz])
    return out


def request_metrics(batch: TimelineBatch) -> RequestMetrics:
    """TTFT, TPOT, E2E, ITL samples and counts for every request of ``batch``. When the batch
    carries integer ns (``event_offsets_ns``: timelines from the collector's records), every
    value is computed from one request's own integers and converted to seconds once, so it does
    not depend on what else is in the batch (:func:`request_metrics_ns`)."""
    rm = _request_metrics(batch)
    if batch.untimed_tokens is not None:  # counted in N after the timed metrics (TPOT is of token events)
        rm = replace(rm, output_tokens=rm.output_tokens + np.asarray(batch.untimed_tokens, np.int64))
    if batch.tokens_unknown is not None:  # N not said: unknown, never the events' count (nor 0)
        unknown = np.asarray(batch.tokens_unknown, bool)
        rm = replace(rm, output_tokens=np.where(unknown, -1, rm.output_tokens), tpot=np.where(unknown, np.nan, rm.tpot))
    if batch.summarised is not None:  # first and last token only: the gap between them is no ITL
        summ = np.asarray(batch.summarised, bool)
        keep = ~summ[rm.itl_request]
        rm = replace(
            rm, itl_max=np.where(summ, np.nan, rm.itl_max), itl=rm.itl[keep], itl_request=rm.itl_request[keep],
            itl_unknown=summ,
        )  # fmt: skip
    return rm


def _request_metrics(batch: TimelineBatch) -> RequestMetrics:
    if batch.event_offsets_ns is not None and batch.submit_ns is not None and batch.end_ns is not None:
        return request_metrics_ns(
            batch.submit_ns, batch.end_ns, batch.offsets, batch.event_offsets_ns, batch.event_tokens
        )
    off = batch.offsets
    start, stop = off[:-1], off[1:]
    m = stop - start
    has = m > 0
    n_req = len(batch)
    et = batch.event_time
    ntok = segment_sum(batch.event_tokens, off)

    first = np.full(n_req, np.nan)
    last = np.full(n_req, np.nan)
    first[has] = et[start[has]]
    last[has] = et[stop[has] - 1]
    ttft = first - batch.submit

    tpot = np.full(n_req, np.nan)
    many = ntok > 1
    tpot[many] = (last[many] - first[many]) / (ntok[many] - 1)

    itl, itl_req = itl_samples(et, off)
    itl_max = _largest_gap(itl, m)

    multi = segment_sum((batch.event_tokens > 1).astype(np.int64), off)
    return RequestMetrics(
        ttft=ttft,
        tpot=tpot,
        e2e=batch.end - batch.submit,
        itl_max=itl_max,
        events=m,
        output_tokens=ntok,
        multi_token_events=multi,
        itl=itl,
        itl_request=itl_req,
    )


def request_metrics_ns(
    submit_ns: np.ndarray,
    end_ns: np.ndarray,
    offsets: np.ndarray,
    event_offsets_ns: np.ndarray,
    event_tokens: np.ndarray,
) -> RequestMetrics:
    """:func:`request_metrics` from integers: request ``i`` was submitted at ``submit_ns[i]``,
    ended at ``end_ns[i]`` (Unix ns) and owns the token events ``event_offsets_ns[offsets[i]:
    offsets[i + 1]]`` (ns after its submit, ascending). Differences are taken in integer ns,
    divided (TPOT) in ns, and converted to seconds once: 90,000,000 ns over 9 gaps is 0.01 s
    exactly as the spec's arithmetic says, in any batch."""
    start, stop = offsets[:-1], offsets[1:]
    m = stop - start
    has = m > 0
    n_req = len(submit_ns)
    ntok = segment_sum(event_tokens, offsets)
    ev = np.asarray(event_offsets_ns, np.int64)
    first = np.zeros(n_req, np.int64)
    last = np.zeros(n_req, np.int64)
    first[has] = ev[start[has]]
    last[has] = ev[stop[has] - 1]
    ttft = np.full(n_req, np.nan)
    ttft[has] = first[has] / 1e9
    tpot = np.full(n_req, np.nan)
    many = ntok > 1
    tpot[many] = ((last[many] - first[many]) / (ntok[many] - 1)) / 1e9
    itl_ns, itl_req = itl_samples(ev, offsets)
    itl_max = _largest_gap(itl_ns, m) / 1e9
    multi = segment_sum((event_tokens > 1).astype(np.int64), offsets)
    return RequestMetrics(
        ttft=ttft,
        tpot=tpot,
        e2e=(np.asarray(end_ns, np.int64) - np.asarray(submit_ns, np.int64)) / 1e9,
        itl_max=itl_max,
        events=m,
        output_tokens=ntok,
        multi_token_events=multi,
        itl=itl_ns / 1e9,
        itl_request=itl_req,
    )


@dataclass(frozen=True)
class SingleRequestMetrics:
    """The spec's per-request numbers for one timeline (seconds; None where undefined)."""

    ttft: float | None
    itl: list[float]
    tpot: float | None
    e2e: float
    output_tokens: int
    multi_token_events: int


def single_request_metrics(tl: Timeline) -> SingleRequestMetrics:
    """:func:`request_metrics` for one request (the same code path, a batch of one)."""
    rm = request_metrics(TimelineBatch.from_timelines([tl]))

    def opt(x: float) -> float | None:
        return None if np.isnan(x) else float(x)

    return SingleRequestMetrics(
        ttft=opt(rm.ttft[0]),
        itl=rm.itl.tolist(),
        tpot=opt(rm.tpot[0]),
        e2e=float(rm.e2e[0]),
        output_tokens=int(rm.output_tokens[0]),
        multi_token_events=int(rm.multi_token_events[0]),
    )
