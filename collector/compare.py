"""Client vs engine, request by request: where the client's time went.

Pure functions over the store's records. Per paired request (both boundaries in one trace):
``client_ttft = network_in + queue + prefill + delivery`` (seconds), client and engine ITL, and a
stall classification. Clock offset between the client's and the engine's hosts
(``theta = engine clock - client clock``) is bounded from the nesting of the engine's span inside
the client's: the engine receives after the client sends (``theta <= e.submit - c.submit``), and
hands out each token and finishes before the client sees them (``theta >= e_i - c_i``,
``theta >= e.end - c.end``). Over many requests the bounds tighten; ``network_in`` and
``delivery`` are corrected by the estimate, the other parts are engine-internal and unaffected.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from otel_llm.summary import Distribution

from .records import RequestRecord


@dataclass
class OffsetEstimate:
    low: float | None  # seconds; theta >= low
    high: float | None  # theta <= high
    theta: float  # applied
    source: str  # "given", "zero (bounds contain 0)", "midpoint of bounds", "no pairs"

    @property
    def width(self) -> float | None:
        return None if self.low is None or self.high is None else self.high - self.low

    @property
    def consistent(self) -> bool:
        return self.width is None or self.width >= 0


def pairs_from_records(
    records: list[RequestRecord],
) -> tuple[list[tuple[RequestRecord, RequestRecord]], list[RequestRecord]]:
    """(client, engine) pairs that the collector matched, and the records left unpaired."""
    by_trace: dict[str, dict[str, list[RequestRecord]]] = {}
    for r in records:
        by_trace.setdefault(r.trace_id, {}).setdefault(r.boundary, []).append(r)
    pairs, alone = [], []
    for t in by_trace.values():
        cl, en = t.get("client", []), t.get("engine", [])
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
    return pairs, alone


def _abs_events(r: RequestRecord) -> np.ndarray:
    return r.submit_ns + np.asarray(r.event_offsets_ns, dtype=np.int64)


def estimate_offset(pairs: list[tuple[RequestRecord, RequestRecord]], given: float | None = None) -> OffsetEstimate:
    if given is not None:
        lo, hi = _bounds(pairs)
        return OffsetEstimate(lo, hi, given, "given")
    if not pairs:
        return OffsetEstimate(None, None, 0.0, "no pairs")
    lo, hi = _bounds(pairs)
    if lo <= 0 <= hi:
        return OffsetEstimate(lo, hi, 0.0, "zero (the bounds contain 0: one clock)")
    return OffsetEstimate(lo, hi, (lo + hi) / 2, "midpoint of the bounds")


def _bounds(pairs) -> tuple[float | None, float | None]:
    if not pairs:
        return None, None
    hi = min(e.submit_ns - c.submit_ns for c, e in pairs)
    lo = max(e.end_ns - c.end_ns for c, e in pairs)
    for c, e in pairs:
        ce, ee = _abs_events(c), _abs_events(e)
        n = min(len(ce), len(ee))
        if n and len(ce) == len(ee):
            lo = max(lo, int((ee - ce).max()))
        elif n:
            lo = max(lo, int(ee[0] - ce[0]))
    return lo / 1e9, hi / 1e9


@dataclass
class RequestComparison:
    id: str
    trace_id: str
    status: str
    client_ttft: float | None
    engine_ttft: float | None
    network_in: float | None
    queue: float | None
    prefill: float | None
    delivery: float | None
    parts_sum_minus_ttft: float | None  # how far the parts miss the client TTFT (0 when all known)
    client_itl_max: float | None
    engine_itl_max: float | None
    client_tokens: int
    engine_tokens: int
    preemptions: int
    preemption_time: float
    stall: str  # none | delivery | engine:preemption | engine:other
    stall_gap: float | None  # the client's largest gap, seconds


def classify_stall(c: RequestRecord, e: RequestRecord, threshold: float) -> tuple[str, float | None]:
    """The client's largest gap: a stall when over ``threshold``; the engine's own gap at the same
    token tells whether the engine caused it (preemption, or other: prefill interference,
    scheduling) or delivery did (the engine handed the tokens out on time)."""
    ce, ee = _abs_events(c), _abs_events(e)
    if len(ce) < 2:
        return "none", None
    gaps = np.diff(ce)
    i = int(np.argmax(gaps))
    gap = gaps[i] / 1e9
    if gap <= threshold:
        return "none", gap
    if len(ee) == len(ce):
        egap = (ee[i + 1] - ee[i]) / 1e9
    else:
        egap = e.itl_max or 0.0
    if egap >= 0.5 * gap:
        return ("engine:preemption" if e.preemptions else "engine:other"), gap
    return "delivery", gap


def compare(records: list[RequestRecord], clock_offset: float | None = None, stall_threshold: float = 0.1):
    pairs, alone = pairs_from_records(records)
    off = estimate_offset(pairs, clock_offset)
    rows = []
    for c, e in pairs:
        net = None if c.network_in is None else c.network_in - off.theta
        dly = None if c.delivery is None else c.delivery + off.theta
        parts = (net, c.queue, c.prefill, dly)
        miss = None if c.ttft is None or any(p is None for p in parts) else sum(parts) - c.ttft
        stall, gap = classify_stall(c, e, stall_threshold)
        rows.append(
            RequestComparison(
                id=c.request_id,
                trace_id=c.trace_id,
                status=c.status,
                client_ttft=c.ttft,
                engine_ttft=e.ttft,
                network_in=net,
                queue=c.queue,
                prefill=c.prefill,
                delivery=dly,
                parts_sum_minus_ttft=miss,
                client_itl_max=c.itl_max,
                engine_itl_max=e.itl_max,
                client_tokens=c.output_tokens,
                engine_tokens=e.output_tokens,
                preemptions=e.preemptions,
                preemption_time=e.preemption_time,
                stall=stall,
                stall_gap=gap,
            )
        )
    return rows, off, pairs, alone


def summarize_comparison(
    rows: list[RequestComparison],
    off: OffsetEstimate,
    pairs,
    alone,
    ps=("50", "90", "99"),
    method: str = "nearest-rank",
) -> dict:
    def dist(name: str, population: str, values) -> dict:
        arr = np.array([np.nan if v is None else v for v in values], dtype=float)
        return Distribution.of(population, arr, ps, method).to_json()

    ok = [r for r in rows if r.status == "ok"]
    out = {
        "requests_paired": len(rows),
        "records_unpaired": len(alone),
        "clock_offset": {
            "theta_s": off.theta,
            "low_s": off.low,
            "high_s": off.high,
            "width_s": off.width,
            "consistent": off.consistent,
            "source": off.source,
            "meaning": "engine clock minus client clock",
        },
        "percentile_method": method,
        "distributions": {},
    }
    d = out["distributions"]
    for key in ("client_ttft", "engine_ttft", "network_in", "queue", "prefill", "delivery"):
        d[key] = dist(key, f"per-request {key} of paired ok requests", [getattr(r, key) for r in ok])
    c_itl = np.concatenate([np.diff(_abs_events(c)) / 1e9 for c, e in pairs if c.status == "ok"] or [np.zeros(0)])
    e_itl = np.concatenate([np.diff(_abs_events(e)) / 1e9 for c, e in pairs if c.status == "ok"] or [np.zeros(0)])
    d["client_itl"] = Distribution.of("pooled client ITL of paired ok requests", c_itl, ps, method).to_json()
    d["engine_itl"] = Distribution.of("pooled engine ITL of paired ok requests", e_itl, ps, method).to_json()
    d["client_itl_max"] = dist("client_itl_max", "per-request max client ITL", [r.client_itl_max for r in ok])
    d["engine_itl_max"] = dist("engine_itl_max", "per-request max engine ITL", [r.engine_itl_max for r in ok])
    known = [r for r in ok if r.parts_sum_minus_ttft is not None and r.client_ttft]
    if known:
        tot = sum(r.client_ttft for r in known)
        out["ttft_share"] = {
            k: sum(getattr(r, k) for r in known) / tot for k in ("network_in", "queue", "prefill", "delivery")
        }
        out["max_abs_parts_sum_error_s"] = max(abs(r.parts_sum_minus_ttft) for r in known)
    out["stalls"] = {k: sum(1 for r in rows if r.stall == k) for k in ("delivery", "engine:preemption", "engine:other")}
    return out


def to_json(rows, summary) -> dict:
    return {"requests": [asdict(r) for r in rows], "summary": summary}
