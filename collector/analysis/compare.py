"""Client vs engine, request by request: where the client's time went.

Pure functions over the store's records. Per paired request (both boundaries in one trace):
the client TTFT in its parts (seconds), from the caller's call to its first token:

    [client_send] + network_in + api_in + front_end + queue + prefill + api_out + network_out

with the HTTP server's span (engine_hooks.asgi; ``client_send`` where the client says when it began
writing the request, else ``network_in`` holds it), or, without it, the adjacent parts merged under
names that say what they hold: ``to_engine`` (= [client_send +] network_in + api_in: the client
library, the network and the HTTP server in) and ``delivery`` (= api_out + network_out:
detokenizing, the API server, the network).
``front_end`` is arrival -> queued where the engine says when its scheduler queued the request
(vLLM does), else unknown and the queue holds it. Also client and engine ITL, and a
stall classification. Clock offset between the client's and the engine's hosts
(``theta = engine clock - client clock``) is bounded from the nesting of the engine's span inside
the client's: the engine receives after the client sends (``theta <= e.submit - c.submit``), and
hands out each token and finishes before the client sees them (``theta >= e_i - c_i``,
``theta >= e.end - c.end``). Over many requests the bounds tighten; ``network_in`` and
``delivery`` are corrected by the estimate, the other parts are engine-internal and unaffected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, make_dataclass, replace
from itertools import pairwise

import numpy as np

from otel_llm.metrics.request_math import itl_samples
from otel_llm.metrics.summary import Distribution
from otel_llm.semconv import Boundary, PairedBy, RequestStatus

from ..pipeline.derive import FROM_ENGINE
from ..pipeline.invariants import tally
from ..pipeline.records import RecordBatch, RequestRecord
from ..pipeline.stalls import (
    ALL_CLASSES,
    DEFAULT_FACTOR,
    DEFAULT_FLOOR_S,
    UNKNOWN,
    classify_stalls,
    engine_gap,
    refine_engine_stall,
)
from ..pipeline.steps import StepBatch
from ..pipeline.ttft_parts import NAMES, PARTS, finest, known_parts


@dataclass
class OffsetEstimate:
    """The clock offset between the client's and the engine's hosts (``theta`` = engine clock minus
    client clock, seconds), NTP style: each pair bounds it (the engine received after the client sent:
    ``theta <= e.submit - c.submit``; it handed each token out before the client got it, and, when both
    completed, finished before the client did: ``theta >= e_i - c_i``, ``theta >= e.end - c.end``).
    Only pairs whose own bounds hold (low <= high) are intersected; the others are excluded and
    counted by reason. When even those disagree, the pair with the narrowest interval (the least
    delay, NTP's choice) decides."""

    low: float | None  # seconds; theta >= low
    high: float | None  # theta <= high
    theta: float  # applied
    source: str  # "given", "zero (bounds contain 0)", "midpoint of bounds", "no pairs", ...
    pairs_used: int = 0
    excluded: dict = field(default_factory=dict)  # reason -> pairs left out of the bounds

    @property
    def width(self) -> float | None:
        return None if self.low is None or self.high is None else self.high - self.low

    @property
    def consistent(self) -> bool:
        return self.width is None or self.width >= 0


def _pair_key(r: RequestRecord) -> str:
    """Where a record's other boundary is: its trace, or, paired by id (a GenAI client span whose
    trace context did not reach the server: two traces), the request's id."""
    if r.paired_by != PairedBy.ID:
        return r.trace_id
    return "id:" + (r.request_id if r.boundary == Boundary.CLIENT else (r.peer_request_id or r.request_id))


def pairs_from_records(
    records: list[RequestRecord],
) -> tuple[list[tuple[RequestRecord, RequestRecord]], list[RequestRecord]]:
    """(client, engine) pairs that the collector matched, then those :func:`pairs_by_id` finds
    among the rest, and the records left unpaired."""
    by_trace: dict[str, dict[str, list[RequestRecord]]] = {}
    for r in records:
        by_trace.setdefault(_pair_key(r), {}).setdefault(r.boundary, []).append(r)
    pairs, alone = [], []
    for t in by_trace.values():
        cl, en = t.get(Boundary.CLIENT, []), t.get(Boundary.ENGINE, [])
        used = set()
        for c in cl:
            if c.peer_request_id is not None:  # the pair derivation made (stores since peer_request_id)
                match = next(
                    (
                        i
                        for i, e in enumerate(en)
                        if i not in used and e.request_id == c.peer_request_id and e.peer_request_id == c.request_id
                    ),
                    None,
                )
            else:  # an older store: the same request id, or the only two records of the trace
                match = next(
                    (
                        i
                        for i, e in enumerate(en)
                        if i not in used
                        and c.paired
                        and e.paired
                        and (e.request_id == c.request_id or (len(cl) == 1 and len(en) == 1))
                    ),
                    None,
                )
            if match is None and len(cl) == 1 and len(en) == 1 and c.paired:
                match = 0
            if match is None:
                alone.append(c)
            else:
                used.add(match)
                pairs.append((c, en[match]))
        alone.extend(e for i, e in enumerate(en) if i not in used)
    more, alone = pairs_by_id(alone)
    return pairs + more, alone


def pairs_by_id(alone: list[RequestRecord]) -> tuple[list[tuple[RequestRecord, RequestRecord]], list[RequestRecord]]:
    """Unpaired client and engine records with one request id, exactly one of each: the same
    request, seen by two collectors (a client span and its engine's in two traces, each sent where
    its trace id led) or past the collector's peer wait. Paired by the id alone, never by time; the
    record views returned for the client carry what only a pair knows (``paired_by`` ``id``, the
    engine's parts, :func:`joined_view`)."""
    clients: dict[str, list[RequestRecord]] = {}
    engines: dict[str, list[RequestRecord]] = {}
    for r in alone:
        if r.request_id and not r.paired:
            if r.boundary == Boundary.CLIENT:
                clients.setdefault(r.request_id, []).append(r)
            elif r.boundary == Boundary.ENGINE:
                engines.setdefault(r.request_id, []).append(r)
    both = {rid for rid, cs in clients.items() if len(cs) == 1 and len(engines.get(rid, ())) == 1}
    if not both:
        return [], alone
    pairs, taken = [], set()
    for rid in sorted(both):
        c, e = clients[rid][0], engines[rid][0]
        pairs.append(joined_view(c, e))
        taken |= {id(c), id(e)}
    return pairs, [r for r in alone if id(r) not in taken]


def joined_view(c: RequestRecord, e: RequestRecord) -> tuple[RequestRecord, RequestRecord]:
    """Two records derived apart, viewed as the pair derivation would have made of them where it
    needs the records alone: each other's id, ``paired_by`` ``id``, the engine's own parts copied to
    the client (as derivation copies them). The parts that need both records' times (the network,
    the server's way in and out) stay unknown."""
    shared = {"paired": True, "paired_by": PairedBy.ID}
    own = {n: getattr(e, n) for n in FROM_ENGINE if getattr(c, n) is None or n in ("preemptions", "preemption_time")}
    return (
        replace(c, **shared, peer_request_id=e.request_id, **own),
        replace(e, **shared, peer_request_id=c.request_id, caller_span_id=e.caller_span_id or c.caller_span_id),
    )


def _abs_events(r: RequestRecord) -> np.ndarray:
    return r.submit_ns + np.asarray(r.event_offsets_ns, dtype=np.int64)


def pair_bounds(c: RequestRecord, e: RequestRecord) -> tuple[int, int]:
    """One pair's bounds on theta, integer ns: (low, high)."""
    hi = e.submit_ns - c.submit_ns
    lo = -(2**62)
    if (
        c.status == RequestStatus.OK and e.status == RequestStatus.OK
    ):  # a client that gave up early: the engine rightly outlives it
        lo = e.end_ns - c.end_ns
    ce, ee = _abs_events(c), _abs_events(e)
    n = min(len(ce), len(ee))
    if n and len(ce) == len(ee):
        lo = max(lo, int((ee - ce).max()))
    elif n:  # chunks merged on the way: the first token is the first at both ends
        lo = max(lo, int(ee[0] - ce[0]))
    return lo, hi


def _bounds(pairs) -> tuple[float | None, float | None, int, dict]:
    """(low, high) in seconds over the pairs whose own bounds hold, how many those are, and the
    others by reason."""
    if not pairs:
        return None, None, 0, {}
    b = [pair_bounds(c, e) for c, e in pairs]
    good = [(lo, hi) for lo, hi in b if lo <= hi]
    excluded = {}
    if len(good) < len(b):
        excluded["bounds of their own do not hold (a clock jump, a span cut short)"] = len(b) - len(good)
    if not good:
        return None, None, 0, excluded
    lo = max(x for x, _ in good)
    hi = min(y for _, y in good)
    if lo > hi:  # the pairs disagree with each other: the least-delay pair alone
        lo, hi = min(good, key=lambda p: p[1] - p[0] if p[0] > -(2**61) else 2**62)
        excluded["disagreeing with the least-delay pair"] = len(good) - 1
        return lo / 1e9, hi / 1e9, 1, excluded
    return lo / 1e9, hi / 1e9, len(good), excluded


def estimate_offset(pairs: list[tuple[RequestRecord, RequestRecord]], given: float | None = None) -> OffsetEstimate:
    lo, hi, used, excluded = _bounds(pairs)
    if given is not None:
        return OffsetEstimate(lo, hi, given, "given", used, excluded)
    if lo is None or hi is None:
        return OffsetEstimate(lo, hi, 0.0, "no pairs" if not pairs else "no pair with bounds that hold", used, excluded)
    if lo < -(2**60) / 1e9:  # no lower bound from any pair (none completed, no token seen at both)
        return OffsetEstimate(None, hi, min(0.0, hi), "at most the upper bound (no lower bound)", used, excluded)
    if lo <= 0 <= hi:
        return OffsetEstimate(lo, hi, 0.0, "zero (the bounds contain 0: one clock)", used, excluded)
    return OffsetEstimate(lo, hi, (lo + hi) / 2, "midpoint of the bounds", used, excluded)


def _parts_of(self) -> dict:
    """This request's TTFT parts at the finest level known (:func:`collector.pipeline.ttft_parts.finest`),
    else those known (:func:`~collector.pipeline.ttft_parts.known_parts`: a client without a first
    token's time still shows the engine's and the server's parts)."""
    values = {n: getattr(self, n) for n in NAMES}
    return finest(values) or known_parts(values)


#: One paired request as ``compare`` sees it: its TTFT at each boundary, its TTFT parts (one field
#: per part of :mod:`collector.pipeline.ttft_parts`, seconds, None unknown; the two-clock parts
#: corrected by the clock offset), how far the parts miss the client TTFT (0 when all known), ITL,
#: tokens, preemptions and the stall (none or one of ``collector.pipeline.stalls.ALL_CLASSES``, with
#: the client's largest gap in seconds).
RequestComparison = make_dataclass(
    "RequestComparison",
    [
        ("id", str),
        ("trace_id", str),
        ("status", str),
        ("client_ttft", float | None),
        ("engine_ttft", float | None),
        *((name, float | None) for name in NAMES),
        ("parts_sum_minus_ttft", float | None),
        ("client_itl_max", float | None),
        ("engine_itl_max", float | None),
        ("client_tokens", int),
        ("engine_tokens", int),
        ("preemptions", int),
        ("preemption_time", float),
        ("stall", str),
        ("stall_gap", float | None),
        ("caller_span_id", str | None),  # the application's span the call ran under (its trace's calls)
        ("submit_ns", int),  # Unix ns, client clock
        ("client_e2e", float | None),
        ("call", int),  # 1, 2, ...: the call's place among its trace's paired calls, by submit
        ("idle_before", float | None),  # s from the trace's previous call's end to this submit: not the model's
        # speculative decoding (None: not known): the engine's account, else the client's copy of it
        ("draft_tokens", int | None),
        ("accepted_tokens", int | None),
        ("acceptance_rate", float | None),
        ("mean_acceptance_length", float | None),
        # the step that ended the client's largest gap: the drafts it verified for the request, those accepted
        ("gap_step_draft_tokens", int | None),
        ("gap_step_accepted_tokens", int | None),
        # disaggregated prefill/decode (None: not a P/D engine): the engine record's role (its parts
        # to_prefill, prefill_leg and pd_hop are among the TTFT's, docs/metrics/disaggregated.md)
        ("pd_role", str | None),
        # how the two records were paired: trace (one trace), id (the client's response id: its trace
        # context did not reach the server)
        ("paired_by", str | None),
    ],
    namespace={"parts": property(_parts_of), "__module__": __name__},
)


def _itl_per_token(records: Sequence[RequestRecord]) -> list[np.ndarray]:
    """Each record's ITL per token in seconds: each gap between token events divided by the
    tokens of the later event (several tokens per event: speculative decoding, or a stream that
    merged outputs); none for a record whose events are summarised."""
    out = []
    for r in records:
        offs = np.asarray(r.event_offsets_ns, np.int64)
        toks = np.asarray(r.event_tokens, np.int64)
        if r.events_summarised or len(offs) < 2:
            out.append(np.zeros(0))
            continue
        order = np.argsort(offs, kind="stable")
        offs, toks = offs[order], toks[order]
        out.append(np.diff(offs) / np.maximum(toks[1:], 1) / 1e9)
    return out


def _speculation(c: RequestRecord, e: RequestRecord) -> dict:
    """A pair's speculation: the engine record's account, else the client's copy of the server's."""
    src = e if e.draft_tokens is not None else c  # a row view: None where unknown
    keys = ("draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length")
    gap = ("gap_step_draft_tokens", "gap_step_accepted_tokens")
    return {k: getattr(src, k) for k in keys} | {k: getattr(e, k) for k in gap}


def _itl_by_request(records: Sequence[RequestRecord]) -> list[np.ndarray]:
    """Each record's ITL samples in seconds, by the metric core's :func:`itl_samples` over the
    integer ns offsets (exact; converted once); none for a record whose events are its first and
    last token only (``events_summarised``)."""
    b = RecordBatch.from_records(records)
    itl_ns, owner = itl_samples(b.event_offsets_ns, b.event_start)
    bounds = np.searchsorted(owner, np.arange(len(records) + 1))
    return [
        itl_ns[a:a] / 1e9 if summ else itl_ns[a:z] / 1e9
        for (a, z), summ in zip(pairwise(bounds.tolist()), b.events_summarised.tolist())
    ]


@dataclass
class Comparison:
    """What :func:`compare` finds: a row per paired request, the clock offset, the pairs and the
    records left unpaired; ``client_itl`` / ``engine_itl`` are each pair's ITL samples (seconds)."""

    rows: list[RequestComparison]
    offset: OffsetEstimate
    pairs: list[tuple[RequestRecord, RequestRecord]]
    alone: list[RequestRecord]
    client_itl: list[np.ndarray]
    engine_itl: list[np.ndarray]
    client_itl_per_token: list[np.ndarray] = field(default_factory=list)  # seconds, each gap / its event's tokens
    engine_itl_per_token: list[np.ndarray] = field(default_factory=list)

    def __iter__(self):  # rows, offset, pairs, alone = compare(...)
        return iter((self.rows, self.offset, self.pairs, self.alone))


def compare(
    records: list[RequestRecord],
    clock_offset: float | None = None,
    stall_threshold: float = DEFAULT_FLOOR_S,
    steps: StepBatch | None = None,
    stall_factor: float = DEFAULT_FACTOR,
) -> Comparison:
    """Pair, decompose and classify. With the engine's ``steps`` (a store's), an ``engine:other``
    stall is refined from the steps of the same engine process over the engine's own gap
    (:func:`collector.pipeline.stalls.refine_engine_stall`)."""
    pairs, alone = pairs_from_records(records)
    off = estimate_offset(pairs, clock_offset)
    c_itl = _itl_by_request([c for c, _ in pairs])
    e_itl = _itl_by_request([e for _, e in pairs])
    stalls, gaps = classify_stalls(
        RecordBatch.from_records([c for c, _ in pairs]),
        RecordBatch.from_records([e for _, e in pairs]),
        stall_threshold,
        stall_factor,
    )
    by_service: dict = {}
    if steps is not None and len(steps):
        for svc in set(steps.service):
            idx = np.flatnonzero([s == svc for s in steps.service])
            part = steps.take(idx)
            by_service[svc] = (part, float(np.median(part.end_ns - part.start_ns)))
    rows = []
    for (c, e), stall, gap in zip(pairs, stalls, gaps.tolist()):
        if stall == "engine:other" and by_service:
            own = by_service.get(e.service) or (next(iter(by_service.values())) if len(by_service) == 1 else None)
            g = engine_gap(c, e)
            if own is not None and g is not None:
                stall = refine_engine_stall(g, *own)
        values = {n: getattr(c, n) for n in NAMES}
        if values["to_engine"] is None and values["network_in"] is not None and c.api_in is None:
            values["to_engine"], values["network_in"] = values["network_in"], None  # a store before the server span
        for p in PARTS:  # the two-clock parts, on one clock
            if p.clock_shift and values[p.name] is not None:
                values[p.name] += p.clock_shift * off.theta
        row_parts = finest(values)
        known = row_parts is not None and c.ttft is not None
        miss = sum(v or 0.0 for v in row_parts.values()) - c.ttft if known else None
        rows.append(
            RequestComparison(
                id=c.request_id,
                trace_id=c.trace_id,
                status=c.status,
                client_ttft=c.ttft,
                engine_ttft=e.ttft,
                **values,
                parts_sum_minus_ttft=miss,
                client_itl_max=c.itl_max,
                engine_itl_max=e.itl_max,
                client_tokens=c.output_tokens,
                engine_tokens=e.output_tokens,
                preemptions=e.preemptions,
                preemption_time=e.preemption_time,
                stall=stall,
                stall_gap=None if gap != gap else gap,
                caller_span_id=c.caller_span_id,
                submit_ns=c.submit_ns,
                client_e2e=c.e2e,
                call=1,
                idle_before=None,
                **_speculation(c, e),
                pd_role=e.pd_role,
                paired_by=c.paired_by or PairedBy.TRACE,
            )
        )
    order_calls(rows)
    per_token = _itl_per_token([c for c, _ in pairs]), _itl_per_token([e for _, e in pairs])
    return Comparison(rows, off, pairs, alone, c_itl, e_itl, *per_token)


def order_calls(rows: Sequence[RequestComparison]) -> dict[str, list[RequestComparison]]:
    """The paired calls of each trace in the order they were made (an agent's turns, a chain's
    steps), by client submit: sets each row's ``call`` (1, 2, ...) and ``idle_before`` (seconds
    from the end of the trace's previous call to this call's submit, on the client's clock: time
    the model did not spend; negative where calls overlap; None for a trace's first call)."""
    by_trace: dict[str, list] = {}
    for r in rows:
        by_trace.setdefault(r.trace_id, []).append(r)
    for calls in by_trace.values():
        calls.sort(key=lambda r: r.submit_ns)
        prev_end = None
        for k, r in enumerate(calls, 1):
            r.call = k
            r.idle_before = None if prev_end is None else (r.submit_ns - prev_end) / 1e9
            if r.client_e2e is not None:
                end = r.submit_ns + round(r.client_e2e * 1e9)
                prev_end = end if prev_end is None else max(prev_end, end)
    return by_trace


@dataclass
class TraceCalls:
    """One trace's paired calls in order (an agent's turns, a chain's steps under one span)."""

    trace_id: str
    caller_span_id: str | None
    calls: list[RequestComparison]  # by ``call``
    span_s: float  # first submit -> last end, client clock
    in_calls_s: float  # the calls' client E2E summed


def traces_of_several_calls(rows, limit: int = 20) -> list[TraceCalls]:
    """The traces holding more than one paired call, the ``limit`` with most calls first, each
    with its calls in order (:func:`order_calls` numbered them): what compare and the report show."""
    by_trace: dict[str, list] = {}
    for r in rows:
        by_trace.setdefault(r.trace_id, []).append(r)
    out = []
    for tid, calls in sorted(by_trace.items(), key=lambda kv: -len(kv[1]))[:limit]:
        if len(calls) < 2:
            break
        calls = sorted(calls, key=lambda r: r.call)
        end = max(r.submit_ns + round((r.client_e2e or 0) * 1e9) for r in calls)
        span = (end - calls[0].submit_ns) / 1e9
        out.append(TraceCalls(tid, calls[0].caller_span_id, calls, span, sum(r.client_e2e or 0 for r in calls)))
    return out


#: The parts of the client TTFT, in the order they happen (:mod:`collector.pipeline.ttft_parts`).
TTFT_PARTS = NAMES


#: Per-request distributions of the summary, in the order they are shown.
PER_REQUEST = ("client_ttft", "engine_ttft", *TTFT_PARTS)


@dataclass
class ComparisonSummary:
    """The distributions and counts of a :class:`Comparison` (seconds)."""

    requests_paired: int
    records_unpaired: int
    offset: OffsetEstimate
    percentile_method: str
    distributions: dict[str, Distribution]  # PER_REQUEST, client/engine_itl, client/engine_itl_max
    stalls: dict[str, int]  # STALL_CLASSES -> requests
    ttft_share: dict[str, float] | None  # TTFT_PARTS -> share of the summed client TTFT
    max_abs_parts_sum_error_s: float | None
    records_with_violations: int = 0  # records compared that break a timeline ordering (collector.pipeline.invariants)
    violations: dict[str, int] = field(default_factory=dict)  # kind -> records
    paired_by_id: int = 0  # of requests_paired: by the client's response id (no trace context at the server)

    def to_json(self) -> dict:
        o = self.offset
        out = {
            "requests_paired": self.requests_paired,
            "paired_by_id": self.paired_by_id,
            "records_unpaired": self.records_unpaired,
            "records_with_violations": self.records_with_violations,
            "violations": self.violations,
            "clock_offset": {
                "theta_s": o.theta,
                "low_s": o.low,
                "high_s": o.high,
                "width_s": o.width,
                "consistent": o.consistent,
                "source": o.source,
                "pairs_used": o.pairs_used,
                "pairs_excluded": o.excluded,
                "meaning": "engine clock minus client clock",
            },
            "percentile_method": self.percentile_method,
            "distributions": {k: d.to_json() for k, d in self.distributions.items()},
        }
        if self.ttft_share is not None:
            out["ttft_share"] = self.ttft_share
            out["max_abs_parts_sum_error_s"] = self.max_abs_parts_sum_error_s
        out["stalls"] = self.stalls
        return out


def ttft_share(rows: Sequence[RequestComparison]) -> dict[str, float | None] | None:
    """Each TTFT part's share of the summed client TTFT over the ok rows whose parts are all known
    (None: no such row); ``front_end`` None where no row knows it (the queue holds it, it is not 0)."""
    known = [r for r in rows if r.status == RequestStatus.OK and r.parts_sum_minus_ttft is not None and r.client_ttft]
    if not known:
        return None
    tot = sum(r.client_ttft for r in known)
    rows_parts = [r.parts for r in known]
    share: dict[str, float | None] = {
        k: sum(p.get(k) or 0.0 for p in rows_parts) / tot for k in TTFT_PARTS if any(k in p for p in rows_parts)
    }
    if all(r.front_end is None for r in known) and any("front_end" in p for p in rows_parts):
        share["front_end"] = None
    return share


def summarize_comparison(
    cmp: Comparison, ps: Sequence[str] = ("50", "90", "99"), method: str = "nearest-rank"
) -> ComparisonSummary:
    def dist(population: str, values) -> Distribution:
        arr = np.array([np.nan if v is None else v for v in values], dtype=float)
        return Distribution.of(population, arr, ps, method)

    rows = cmp.rows
    ok = [r for r in rows if r.status == RequestStatus.OK]
    present = set().union(*(r.parts for r in rows)) if rows else set()
    keys = [k for k in PER_REQUEST if k in ("client_ttft", "engine_ttft") or k in present]
    d = {key: dist(f"per-request {key} of paired ok requests", [getattr(r, key) for r in ok]) for key in keys}
    is_ok = [r.status == RequestStatus.OK for r in rows]
    for side, samples in ((Boundary.CLIENT, cmp.client_itl), (Boundary.ENGINE, cmp.engine_itl)):
        pooled = np.concatenate([x for x, keep in zip(samples, is_ok) if keep] or [np.zeros(0)])
        d[f"{side}_itl"] = Distribution.of(f"pooled {side} ITL of paired ok requests", pooled, ps, method)
    if any(r.draft_tokens is not None for r in rows):  # speculative decoding: events of several tokens
        for side, samples in ((Boundary.CLIENT, cmp.client_itl_per_token), (Boundary.ENGINE, cmp.engine_itl_per_token)):
            pooled = np.concatenate([x for x, keep in zip(samples, is_ok) if keep] or [np.zeros(0)])
            d[f"{side}_itl_per_token"] = Distribution.of(
                f"pooled {side} ITL per token (each gap / the tokens of its later event) of paired ok requests",
                pooled,
                ps,
                method,
            )
        d["acceptance_rate"] = dist(
            "per-request acceptance rate (accepted / draft tokens) of paired ok requests that drafted",
            [r.acceptance_rate for r in ok],
        )
    d["client_itl_max"] = dist("per-request max client ITL", [r.client_itl_max for r in ok])
    d["engine_itl_max"] = dist("per-request max engine ITL", [r.engine_itl_max for r in ok])
    d["client_e2e"] = dist("per-request client E2E of paired ok requests", [r.client_e2e for r in ok])
    known = [r for r in ok if r.parts_sum_minus_ttft is not None and r.client_ttft]
    share = ttft_share(rows)
    err = max(abs(r.parts_sum_minus_ttft) for r in known) if known else None
    violations = [r.violations for pair in cmp.pairs for r in pair] + [r.violations for r in cmp.alone]
    return ComparisonSummary(
        records_with_violations=sum(1 for v in violations if v),
        violations=dict(sorted(tally(violations).items())),
        requests_paired=len(rows),
        paired_by_id=sum(r.paired_by == PairedBy.ID for r in rows),
        records_unpaired=len(cmp.alone),
        offset=cmp.offset,
        percentile_method=method,
        distributions=d,
        stalls={k: sum(1 for r in rows if r.stall == k) for k in (*ALL_CLASSES, UNKNOWN)},
        ttft_share=share,
        max_abs_parts_sum_error_s=err,
    )


def to_json(cmp: Comparison, summary: ComparisonSummary) -> dict:
    return {"requests": [asdict(r) for r in cmp.rows], "summary": summary.to_json()}
