"""What ``otel-llm report`` shows, computed from records and engine steps: pure functions, no I/O.

Every time is in seconds after the run's origin (the earliest client send, else the earliest engine
arrival). Engine times are moved onto the client's clock by the clock offset ``compare`` estimates
(engine clock minus client clock), so both boundaries and the engine's steps share one axis.
Durations are seconds; token counts are tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from otel_llm.metrics.percentiles import percentiles
from otel_llm.metrics.slo import SLO
from otel_llm.metrics.summary import Summary, summarize
from otel_llm.metrics.timeline import BOUNDARIES
from otel_llm.semconv import Boundary, RequestStatus

from ..pipeline.records import RecordBatch, RequestRecord
from ..pipeline.stalls import ALL_CLASSES, DEFAULT_FACTOR, DEFAULT_FLOOR_S, STALL_CLASSES, UNKNOWN
from ..pipeline.steps import StepBatch
from ..pipeline.ttft_parts import MEANING
from .compare import Comparison, RequestComparison, TraceCalls, compare, traces_of_several_calls, ttft_share
from .run_profile import profile_run

#: What each part of the client TTFT holds (shown in the report beside the bars).
PART_MEANING = MEANING


@dataclass
class WaterfallRow:
    """One request on the shared time axis (seconds after the origin; None: not known)."""

    id: str
    group: str  # "slowest" | "sample"
    status: str
    client_submit: float | None
    client_end: float | None
    client_tokens: list[float]
    engine_arrival: float | None
    queue_start: float | None
    first_scheduled: float | None
    first_generated: float | None
    engine_end: float | None
    engine_tokens: list[float]
    preemptions: int
    preemption_time: float
    server_received: float | None = None  # the HTTP server read the request (same host as the engine)
    server_end: float | None = None  # its last body chunk written
    server_tokens: list[float] = field(default_factory=list)  # the chunks that carried tokens
    # disaggregated prefill/decode: the prefill engine's leg (its clock, taken as the engine host's),
    # and the decode engine's KV transfer (its load started -> seen complete), inside its wait
    prefill_leg_start: float | None = None
    prefill_leg_end: float | None = None
    kv_start: float | None = None
    kv_end: float | None = None


Unit = tuple  # (client, engine, server) records of one request, None where that boundary is missing


def request_units(records: list[RequestRecord], cmp: Comparison) -> list[Unit]:
    """One unit per request: its client and engine records as ``compare`` paired them (or alone),
    with the server boundary's record of the same trace and request beside its engine's, never a
    request of its own."""
    servers = {(r.trace_id, r.request_id): r for r in records if r.boundary == Boundary.SERVER}
    take = lambda e: servers.pop((e.trace_id, e.request_id), None) if e is not None else None
    paired = {id(c) for c, _ in cmp.pairs} | {id(e) for _, e in cmp.pairs}
    units = [(c, e, take(e)) for c, e in cmp.pairs]
    for r in records:
        if id(r) in paired or r.boundary == Boundary.SERVER:
            continue
        units.append((r, None, None) if r.boundary == Boundary.CLIENT else (None, r, take(r)))
    return units + [(None, None, s) for s in servers.values()]


@dataclass
class StepSeries:
    """The engine's steps on the shared axis (at most ``limit`` of them; ``kept`` says how many)."""

    start: np.ndarray
    duration: np.ndarray
    batch_size: np.ndarray
    prefill_tokens: np.ndarray
    decode_tokens: np.ndarray
    preempted: np.ndarray
    kv_usage: np.ndarray
    total: int
    kept: int


@dataclass
class SweepPoint:
    """One run of a sweep: its load and what it achieved (client boundary), and where the client's
    TTFT went (mean parts, seconds) when the engine's records are there too."""

    run_id: str
    requests: int
    arrival_rate: float | None  # client sends per second over the run: (n - 1) / (last - first send)
    requests_per_s: float | None
    attainment: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    parts_mean: dict[str, float] = field(default_factory=dict)  # TTFT part -> mean seconds
    batch_size_mean: float | None = None
    preemptions: int | None = None


@dataclass
class ReportData:
    title: str
    source: str
    origin_ns: int
    runs: list[tuple[str, int]]  # (run id, client records)
    services: list[str]
    summaries: dict[str, Summary]  # by boundary
    clock_offset_s: float | None
    clock_offset_width_s: float | None
    paired: int
    decomposition: list[tuple[str, dict[str, float]]]  # (label, part -> seconds)
    waterfall: list[WaterfallRow]
    steps: StepSeries | None
    itl_cdf: dict[str, tuple[np.ndarray, np.ndarray]]  # side -> (seconds, cumulative fraction)
    over_time: dict[str, tuple[np.ndarray, np.ndarray]]  # metric -> (submit s, value s)
    stall_seconds: dict[str, float]
    stall_requests: dict[str, int]
    sweep: list[SweepPoint] = field(default_factory=list)
    ttft_share: dict[str, float | None] | None = None  # TTFT part -> share of the summed client TTFT
    traces: list[TraceCalls] = field(default_factory=list)  # traces of several calls, most calls first
    # speculative decoding: the paired requests whose acceptance is known (compare's rows)
    acceptance: list[RequestComparison] = field(default_factory=list)


def _s(ns: int | None, origin: int) -> float | None:
    return None if ns is None or ns < 0 else (ns - origin) / 1e9


def _cdf(samples: np.ndarray, points: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """An empirical CDF with at most ``points`` steps (quantiles of the sorted samples)."""
    x = np.sort(samples[np.isfinite(samples)])
    if not len(x):
        return np.zeros(0), np.zeros(0)
    idx = np.unique(np.linspace(0, len(x) - 1, min(points, len(x))).astype(np.int64))
    return x[idx], (idx + 1) / len(x)


def _events(r: RequestRecord, origin: int, shift_ns: int = 0) -> list[float]:
    offs = np.asarray(r.event_offsets_ns, dtype=np.int64)
    return ((r.submit_ns + offs - shift_ns - origin) / 1e9).tolist()


def waterfall_rows(
    pairs: list[Unit],
    origin: int,
    theta_ns: int,
    slowest: int,
    sample: int,
    seed: int = 0,
) -> list[WaterfallRow]:
    """The ``slowest`` requests by E2E (client's, else engine's), then a seeded sample of the rest."""

    def e2e(p):
        r = next(x for x in p if x is not None)  # the client's, else the engine's, else the server's
        return r.e2e if r.e2e is not None else -1.0

    order = sorted(range(len(pairs)), key=lambda i: -e2e(pairs[i]))
    top = order[:slowest]
    rest = order[slowest:]
    picked = random.Random(seed).sample(rest, min(sample, len(rest)))
    rows = []
    for group, idxs in (("slowest", top), ("sample", sorted(picked, key=lambda i: -e2e(pairs[i])))):
        for i in idxs:
            c, e, s = pairs[i]
            row = WaterfallRow(
                id=(c or e or s).request_id,
                group=group,
                status=(c or e or s).status,
                client_submit=_s(c.submit_ns, origin) if c else None,
                client_end=_s(c.end_ns, origin) if c else None,
                client_tokens=_events(c, origin) if c else [],
                engine_arrival=None,
                queue_start=None,
                first_scheduled=None,
                first_generated=None,
                engine_end=None,
                engine_tokens=[],
                preemptions=e.preemptions if e else 0,
                preemption_time=e.preemption_time if e else 0.0,
            )
            if e is not None:
                sh = origin + theta_ns
                row.engine_arrival = _s(e.submit_ns, sh)
                row.engine_end = _s(e.end_ns, sh)
                row.first_scheduled = _s(e.first_scheduled_ns, sh)
                row.first_generated = _s(e.first_generated_ns, sh)
                kv = (e.kv_transfer or 0.0) + (e.kv_ready or 0.0)  # a P/D decode engine's queue ends at its load
                if row.first_scheduled is not None and e.queue is not None:
                    row.queue_start = row.first_scheduled - kv - e.queue
                if row.first_scheduled is not None and e.kv_transfer is not None and e.kv_ready is not None:
                    row.kv_end = row.first_scheduled - e.kv_ready
                    row.kv_start = row.kv_end - e.kv_transfer
                if e.prefill_arrival_ns is not None and e.prefill_leg is not None:
                    row.prefill_leg_start = _s(e.prefill_arrival_ns, sh)
                    row.prefill_leg_end = row.prefill_leg_start + e.prefill_leg
                row.engine_tokens = _events(e, origin, theta_ns)
            if s is not None:  # the server runs on the engine's host: the engine's clock shift
                row.server_received = _s(s.submit_ns, origin + theta_ns)
                row.server_end = _s(s.end_ns, origin + theta_ns)
                row.server_tokens = _events(s, origin, theta_ns)
            rows.append(row)
    return rows


def _steps_of_the_run(steps: StepBatch, records: list[RequestRecord]) -> StepBatch:
    """The steps from the selected requests' first engine arrival to their last engine end (engine
    clock): a run's warm-up requests are not drawn, so neither are the steps that served them."""
    engine = [r for r in records if r.boundary == Boundary.ENGINE]
    if not engine or not len(steps):
        return steps
    lo, hi = min(r.submit_ns for r in engine), max(r.end_ns for r in engine)
    return steps.take(np.flatnonzero((steps.end_ns >= lo) & (steps.start_ns <= hi)))


def step_series(steps: StepBatch, origin: int, theta_ns: int, limit: int = 20_000) -> StepSeries | None:
    """The steps on the shared axis; past ``limit``, every k-th step plus every step that is the
    longest of its stretch (so a slow step is never thinned away)."""
    n = len(steps)
    if not n:
        return None
    keep = np.arange(n)
    if n > limit:
        k = -(-n // (limit // 2))
        dur = steps.end_ns - steps.start_ns
        longest = np.array([a + int(np.argmax(dur[a : a + k])) for a in range(0, n, k)])
        keep = np.union1d(np.arange(0, n, k), longest)
    return StepSeries(
        start=(steps.start_ns[keep] - theta_ns - origin) / 1e9,
        duration=(steps.end_ns[keep] - steps.start_ns[keep]) / 1e9,
        batch_size=steps.batch_size[keep],
        prefill_tokens=steps.prefill_tokens[keep],
        decode_tokens=steps.decode_tokens[keep],
        preempted=steps.preempted[keep],
        kv_usage=steps.kv_usage[keep],
        total=n,
        kept=len(keep),
    )


def decomposition(cmp: Comparison, slowest: int, ps=("50", "90", "99")) -> list[tuple[str, dict[str, float]]]:
    """The client TTFT in its parts: for the request at each percentile of the client TTFT
    (nearest rank), then for the ``slowest`` requests. Only requests whose parts are all known."""
    rows = [r for r in cmp.rows if r.status == RequestStatus.OK and r.parts_sum_minus_ttft is not None]
    if not rows:
        return []
    rows.sort(key=lambda r: r.client_ttft)
    ttfts = np.array([r.client_ttft for r in rows])
    out = []
    for p in ps:
        (v,) = percentiles(ttfts, [p], "nearest-rank", presorted=True)
        r = rows[int(np.searchsorted(ttfts, v))]
        out.append((f"p{p} ({r.id})", {k: v or 0.0 for k, v in r.parts.items()}))
    for r in rows[::-1][:slowest]:
        out.append((r.id, {k: v or 0.0 for k, v in r.parts.items()}))
    return out


def sweep_points(batch: RecordBatch, steps: StepBatch | None, slo: SLO | None) -> list[SweepPoint]:
    """One point per run id (nothing for fewer than two runs), in order of arrival rate: the
    profile of :func:`collector.analysis.run_profile.profile_run`, as ``otel-llm bench --sweep`` records it."""
    client = batch.at_boundary(Boundary.CLIENT)
    runs = sorted({r for r in client.run_id if r})
    if len(runs) < 2:
        return []
    out = []
    for run in runs:
        prof = profile_run(batch, steps, run, slo, ps=("50", "99"))
        c = prof["boundaries"].get(Boundary.CLIENT)
        if c is None:
            continue
        sub = np.sort(client.submit_ns[[r == run for r in client.run_id]])
        lat = c["latency"]
        dec, eng = prof["decomposition"] or {}, prof["engine"] or {}
        span = (int(sub[-1]) - int(sub[0])) / 1e9 if len(sub) > 1 else 0.0
        out.append(
            SweepPoint(
                run_id=run,
                requests=c["counts"]["requests"],
                arrival_rate=(len(sub) - 1) / span if span > 0 else None,
                requests_per_s=c["throughput"]["requests_per_s"],
                attainment=(c["goodput"] or {}).get("attainment"),
                ttft_p50=lat["ttft"]["p50"],
                ttft_p99=lat["ttft"]["p99"],
                tpot_p50=lat["tpot"]["p50"],
                tpot_p99=lat["tpot"]["p99"],
                e2e_p50=lat["e2e"]["p50"],
                e2e_p99=lat["e2e"]["p99"],
                parts_mean={k: v for k, v in (dec.get("parts_mean_s") or {}).items() if v is not None},
                batch_size_mean=eng.get("batch_size_mean"),
                preemptions=eng.get("preemptions"),
            )
        )
    out.sort(key=lambda p: p.arrival_rate or 0)
    return out


def build_report(
    batch: RecordBatch,
    steps: StepBatch | None,
    *,
    source: str,
    slo: SLO | None = None,
    slowest: int = 20,
    sample: int = 100,
    stall_threshold: float = DEFAULT_FLOOR_S,
    stall_factor: float = DEFAULT_FACTOR,
    title: str = "otel-llm report",
) -> ReportData:
    """Everything the report draws, from the selected records (both boundaries) and steps."""
    records = batch.records()
    if not records:
        raise ValueError("no records to report on")
    client = [r for r in records if r.boundary == Boundary.CLIENT]
    origin = min(r.submit_ns for r in (client or records))
    cmp = compare(records, None, stall_threshold, steps, stall_factor)
    theta_ns = round(cmp.offset.theta * 1e9)
    summaries = {}
    for b in BOUNDARIES:
        part = batch.at_boundary(b)
        if len(part):
            summaries[b] = summarize(part.timelines(epoch_ns=0), slo=slo)
    paired_ids = {id(c) for c, _ in cmp.pairs} | {id(e) for _, e in cmp.pairs}
    units = request_units(records, cmp)
    c_itl = [x for x in cmp.client_itl if len(x)]
    e_itl = [x for x in cmp.engine_itl if len(x)]
    engine_alone = [r for r in records if r.boundary == Boundary.ENGINE and id(r) not in paired_ids]
    if not cmp.pairs:  # no pairs: each boundary's own ITL
        from .compare import _itl_by_request

        c_itl = [x for x in _itl_by_request(client) if len(x)]
        e_itl = [x for x in _itl_by_request(engine_alone) if len(x)]
    itl = {}
    for side, xs in ((Boundary.CLIENT, c_itl), (Boundary.ENGINE, e_itl)):
        if xs:
            itl[side] = _cdf(np.concatenate(xs))
    over = {}
    base = client or records
    sub = np.array([(r.submit_ns - origin) / 1e9 for r in base])
    for metric in ("ttft", "e2e"):
        v = np.array([np.nan if getattr(r, metric) is None else getattr(r, metric) for r in base])
        ok = np.isfinite(v)
        over[metric] = (sub[ok], v[ok])
    # the causes compare and /metrics count, and those the engine's steps refined engine:other into
    stall_n = {k: sum(r.stall == k for r in cmp.rows) for k in (*ALL_CLASSES, UNKNOWN)}
    stall_n = {k: n for k, n in stall_n.items() if n or k in STALL_CLASSES}
    stall_s = {k: sum(r.stall_gap or 0.0 for r in cmp.rows if r.stall == k) for k in stall_n}
    run_counts: dict[str, int] = {}
    for r in client:
        run_counts[r.run_id or "-"] = run_counts.get(r.run_id or "-", 0) + 1
    return ReportData(
        title=title,
        source=source,
        origin_ns=origin,
        runs=sorted(run_counts.items()),
        services=sorted({r.service for r in records if r.service}),
        summaries=summaries,
        clock_offset_s=cmp.offset.theta if cmp.pairs else None,
        clock_offset_width_s=cmp.offset.width if cmp.pairs else None,
        paired=len(cmp.pairs),
        decomposition=decomposition(cmp, slowest),
        waterfall=waterfall_rows(units, origin, theta_ns, slowest, sample),
        steps=step_series(_steps_of_the_run(steps, records), origin, theta_ns) if steps is not None else None,
        itl_cdf=itl,
        over_time=over,
        stall_seconds=stall_s,
        stall_requests=stall_n,
        sweep=sweep_points(batch, steps, slo),
        ttft_share=ttft_share(cmp.rows),
        traces=traces_of_several_calls(cmp.rows, slowest),
        acceptance=[r for r in cmp.rows if r.acceptance_rate is not None],
    )
