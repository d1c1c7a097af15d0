"""Window statistics over many requests (docs/metrics/spec.md: "Many requests", "Percentiles",
"Goodput"). Plain dataclasses for what is measured; formatting lives in :mod:`otel_llm.metrics.summary_format`.

Units: seconds, requests/s, tokens/s; TPOT in seconds per token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .fluidity import FluidityTarget, fluid_token_rate, miss_rates
from .percentiles import Percent, percentile_key, percentiles
from .request_math import RequestMetrics, request_metrics
from .slo import SLO
from .timeline import CANCELLED, ERROR, OK, REJECTED, TimelineBatch
from .window import Window

DEFAULT_PERCENTILES: tuple[str, ...] = ("50", "90", "95", "99")

#: The population each latency distribution sorts (printed with every percentile).
POPULATIONS = {
    "ttft": "per-request TTFT of completed requests with a token",
    "tpot": "per-request TPOT of completed requests with N > 1 tokens",
    "itl": "pooled ITL: every gap of every completed request (long outputs contribute more samples)",
    "itl_max": "per-request largest ITL of completed requests with 2+ token events",
    "e2e": "per-request E2E of completed requests",
    "deadline_miss_rate": "per-request missed / total token deadlines of completed requests with a token "
    "(1 - fluidity index)",
}


@dataclass
class Distribution:
    population: str
    n: int
    mean: float | None
    min: float | None
    max: float | None
    percentiles: dict[str, float | None]  # key "p%g" -> seconds

    @classmethod
    def of(cls, population: str, samples: np.ndarray, ps: Sequence[Percent], method: str) -> Distribution:
        # sorted once: percentiles, min, max, and a mean that does not depend on input order
        s = np.sort(samples[~np.isnan(samples)])
        n = len(s)
        vals = percentiles(s, ps, method, presorted=True)
        return cls(
            population,
            n,
            float(np.mean(s)) if n else None,
            float(s[0]) if n else None,
            float(s[-1]) if n else None,
            {percentile_key(p): v for p, v in zip(ps, vals)},
        )

    def to_json(self) -> dict:
        d = {"population": self.population, "n": self.n, "mean": self.mean, "min": self.min, "max": self.max}
        d.update(self.percentiles)
        return d


@dataclass
class Counts:
    requests: int  # all requests in the data
    completed: int  # status ok, end in window
    failed: int  # status error, end in window
    cancelled: int
    rejected: int
    tpot_undefined: int  # completed with N <= 1
    no_token: int  # completed with no token event
    multi_token_events: int  # token events of completed requests carrying more than one token
    summarised: int = 0  # completed with their first and last token only (TimelineBatch.summarised): no ITL
    tokens_unknown: int = 0  # completed whose source did not say their token count: N, TPOT unknown


@dataclass
class Goodput:
    slo: dict[str, float]
    tpot_undefined: str
    good: int
    requests_per_s: float | None
    output_tokens_per_s: float | None  # the good requests' whole outputs / T ("goodput in tokens")
    attainment: float | None  # good / judged (completed, judged on every bound); None when none
    attainment_by_bound: dict[str, float | None]  # per bound: met / judged on it
    # completed requests that cannot be judged on a bound (bound_judged): never good, out of attainment
    unjudged: int = 0
    unjudged_by_bound: dict[str, int] = field(default_factory=dict)


@dataclass
class Fluidity:
    """The fluidity index of the completed requests (docs/metrics/fluidity.md)."""

    ttft_deadline: float  # s
    tbt_deadline: float  # s
    target: float
    miss_rate: Distribution  # per request, missed / total deadlines (low is good: p99 is the worst-off 1%)
    index_mean: float | None  # mean over requests of 1 - miss rate
    attainment: float | None  # share of those requests whose index >= target
    share: float = 0.99  # of requests, for the fluid token generation rate
    fluid_token_rate: float | None = None  # tokens/s: 1 / the smallest tbt at which ``share`` are fluid

    def to_json(self) -> dict:
        return {
            "ttft_deadline": self.ttft_deadline,
            "tbt_deadline": self.tbt_deadline,
            "target": self.target,
            "index_mean": self.index_mean,
            "attainment": self.attainment,
            "share": self.share,
            # inf (every deadline down to 1 us kept: the first token's slack covers the rest) -> "unbounded"
            "fluid_token_rate_per_s": "unbounded" if self.fluid_token_rate == math.inf else self.fluid_token_rate,
            "deadline_miss_rate": self.miss_rate.to_json(),
        }


@dataclass
class Summary:
    window: Window
    counts: Counts
    requests_per_s: float | None
    output_tokens_per_s: float | None
    output_tokens_in_window: int | float  # an estimate (float) from sampled records
    percentile_method: str
    latency: dict[str, Distribution]
    goodput: Goodput | None
    extra: dict = field(default_factory=dict)  # conditions etc., passed through to JSON
    fluidity: Fluidity | None = None
    sampling: dict | None = None  # sampled records: what the estimates stand for
    violations: dict | None = None  # records breaking the timeline invariants (TimelineBatch.violations)

    def to_json(self) -> dict:
        c = self.counts
        out = {
            "window": {
                "start": self.window.start,
                "end": self.window.end,
                "seconds": self.window.seconds,
                "source": "given" if self.window.explicit else "earliest submit to latest end",
            },
            "counts": {
                "requests": c.requests,
                "completed": c.completed,
                "failed": c.failed,
                "cancelled": c.cancelled,
                "rejected": c.rejected,
                "tpot_undefined": c.tpot_undefined,
                "no_token": c.no_token,
                "multi_token_events": c.multi_token_events,
                "summarised": c.summarised,
                "tokens_unknown": c.tokens_unknown,
            },
            "throughput": {
                "requests_per_s": self.requests_per_s,
                "output_tokens_per_s": self.output_tokens_per_s,
                "output_tokens": self.output_tokens_in_window,
            },
            "percentile_method": self.percentile_method,
            "latency": {k: d.to_json() for k, d in self.latency.items()},
            "goodput": None,
        }
        if self.fluidity is not None:
            out["fluidity"] = self.fluidity.to_json()
        if self.sampling is not None:
            out["sampling"] = self.sampling
        if self.violations is not None:
            out["timeline_violations"] = self.violations
        if self.goodput is not None:
            g = self.goodput
            out["goodput"] = {
                "slo": g.slo,
                "tpot_undefined": g.tpot_undefined,
                "good": g.good,
                "requests_per_s": g.requests_per_s,
                "output_tokens_per_s": g.output_tokens_per_s,
                "attainment": g.attainment,
                "attainment_by_bound": g.attainment_by_bound,
                "unjudged": g.unjudged,
                "unjudged_by_bound": g.unjudged_by_bound,
            }
        out.update(self.extra)
        return out


def _rate(count: int, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None


def weighted_sum(values: np.ndarray, weight: np.ndarray | None, which: np.ndarray) -> int | float:
    """``values[which]`` summed, each request counting for its sample weight (docs/metrics/spec.md,
    "Sampling"); an int, as before sampling existed, when there are no weights. ``which``: a mask or
    indices over the requests."""
    if weight is None:
        return int(values[which].sum())
    return float((values[which] * weight[which]).sum())


def bound_judged(rm: RequestMetrics, slo: SLO) -> dict[str, np.ndarray]:
    """For each bound of ``slo``, a boolean per request: can it be judged on that bound at all (its
    source says what the bound needs)? Not a ``tpot`` bound where the token count is unknown
    (``output_tokens`` -1), not an ``itl_max`` bound where only the first and last token are known
    (``itl_unknown``: vLLM's own spans, a GenAI client span), not a ``ttft`` bound where such a
    source gave not even the first (a GenAI client span without ``time_to_first_chunk``: its request
    had tokens, their time is not known; a request of another source without a token fails the
    bound). An unjudged request is never good and is left out of attainment (docs/metrics/spec.md,
    "Goodput")."""
    n = len(rm.e2e)
    out: dict[str, np.ndarray] = {}
    summarised = np.zeros(n, bool) if rm.itl_unknown is None else np.asarray(rm.itl_unknown, bool)
    for name in slo.bounds:
        if name == "tpot":
            out[name] = rm.output_tokens >= 0
        elif name == "itl_max":
            out[name] = ~summarised
        elif name == "ttft":
            out[name] = ~(summarised & (rm.events == 0))
        else:
            out[name] = np.ones(n, bool)
    return out


def bound_checks(rm: RequestMetrics, slo: SLO) -> dict[str, np.ndarray]:
    """For each bound of ``slo``, a boolean per request: does it meet that bound (spec rules for
    undefined values: TPOT per ``slo.tpot_undefined``, ITL max vacuous with < 2 events, and any
    ``ttft`` or ``itl_max`` bound fails with no token at all). A request that cannot be judged on
    a bound (:func:`bound_judged`) does not meet it: unknown is never a pass."""
    no_token = rm.events == 0
    judged = bound_judged(rm, slo)
    out: dict[str, np.ndarray] = {}
    for name, bound in slo.bounds.items():
        if name == "ttft":
            ok = ~no_token & (np.nan_to_num(rm.ttft, nan=np.inf) <= bound)
        elif name == "tpot":
            undefined = np.isnan(rm.tpot)
            ok = np.where(undefined, slo.tpot_undefined == "pass", np.nan_to_num(rm.tpot, nan=0.0) <= bound)
        elif name == "itl_max":
            ok = ~no_token & (np.isnan(rm.itl_max) | (np.nan_to_num(rm.itl_max, nan=0.0) <= bound))
        else:  # e2e
            ok = rm.e2e <= bound
        out[name] = ok & judged[name]
    return out


def _fluidity(batch: TimelineBatch, which: np.ndarray, t: FluidityTarget, ps, method: str) -> Fluidity:
    if batch.event_offsets_ns is not None:
        offs_ns = batch.event_offsets_ns
    else:  # timelines in seconds: each event's offset from its request's submit, rounded to ns
        rel = batch.event_time - np.repeat(batch.submit, np.diff(batch.offsets))
        offs_ns = np.round(rel * 1e9).astype(np.int64)
    idx = np.flatnonzero(which)
    rates = miss_rates(batch.offsets, offs_ns, batch.event_tokens, idx, t)
    index = 1.0 - rates
    return Fluidity(
        t.ttft,
        t.tbt,
        t.target,
        Distribution.of(POPULATIONS["deadline_miss_rate"], rates, ps, method),
        float(index.mean()) if len(index) else None,
        float((index >= t.target).mean()) if len(index) else None,
        t.share,
        fluid_token_rate(batch.offsets, offs_ns, batch.event_tokens, idx, t),
    )


def _weighted_count(n: int, wt: np.ndarray | None):
    """``count(mask)``: the requests of ``mask``, each counting for its weight (1 unsampled)."""
    one = np.ones(n, np.int64)
    return lambda mask: weighted_sum(one, wt, mask)


def _tokens_in_window(batch: TimelineBatch, w: Window, wt: np.ndarray | None):
    """Output tokens whose event is in the window (a response not streamed: at its end), weighted."""
    in_tok = w.contains(batch.event_time)
    if batch.tokens_unknown is not None:  # a request whose count is unknown: none of its tokens counted
        in_tok &= ~np.repeat(np.asarray(batch.tokens_unknown, bool), np.diff(batch.offsets))
    if wt is None:
        tok_in = int(batch.event_tokens[in_tok].sum())
    else:
        tok_in = float((batch.event_tokens * np.repeat(wt, np.diff(batch.offsets)))[in_tok].sum())
    if batch.untimed_tokens is not None:  # a response not streamed: its tokens observed at its end
        ends_in = w.contains(batch.end)
        tok_in += weighted_sum(np.asarray(batch.untimed_tokens, np.int64), wt, ends_in)
    return tok_in


def _counts(batch: TimelineBatch, rm: RequestMetrics, in_win: np.ndarray, completed: np.ndarray) -> Counts:
    """The requests by status (end in window), and what the completed ones' timelines leave unknown."""
    st = batch.status
    return Counts(
        requests=len(batch),
        completed=int(completed.sum()),
        failed=int((in_win & (st == ERROR)).sum()),
        cancelled=int((in_win & (st == CANCELLED)).sum()),
        rejected=int((in_win & (st == REJECTED)).sum()),
        tpot_undefined=int((completed & (rm.output_tokens >= 0) & (rm.output_tokens <= 1)).sum()),
        tokens_unknown=int((completed & (rm.output_tokens < 0)).sum()),
        no_token=int((completed & (rm.events == 0)).sum()),
        multi_token_events=int(rm.multi_token_events[completed].sum()),
        summarised=0 if batch.summarised is None else int((completed & batch.summarised).sum()),
    )


def _goodput(rm: RequestMetrics, slo: SLO, completed: np.ndarray, wt: np.ndarray | None, T: float) -> Goodput:
    """Goodput under ``slo``: the completed requests that meet every bound, per second of ``T``."""
    n_of = _weighted_count(len(completed), wt)
    checks, judged_by = bound_checks(rm, slo), bound_judged(rm, slo)
    judged = completed.copy()
    for j in judged_by.values():
        judged &= j
    good_mask = judged.copy()
    for ok in checks.values():
        good_mask &= ok
    good_n, judged_n = n_of(good_mask), n_of(judged)
    return Goodput(
        slo=slo.bounds,
        tpot_undefined=slo.tpot_undefined,
        good=int(good_mask.sum()),
        # nothing judged (every completed request unjudged): goodput unknown, not 0
        requests_per_s=_rate(good_n, T) if judged.any() or not completed.any() else None,
        output_tokens_per_s=_rate(weighted_sum(np.maximum(rm.output_tokens, 0), wt, good_mask), T)
        if judged.any() or not completed.any()
        else None,
        attainment=good_n / judged_n if judged.any() else None,
        attainment_by_bound={
            k: (
                n_of(completed & judged_by[k] & ok) / n_of(completed & judged_by[k])
                if (completed & judged_by[k]).any()
                else None
            )
            for k, ok in checks.items()
        },
        unjudged=int((completed & ~judged).sum()),
        unjudged_by_bound={k: int((completed & ~j).sum()) for k, j in judged_by.items() if (completed & ~j).any()},
    )


def summarize(
    batch: TimelineBatch,
    window: Window | None = None,
    slo: SLO | None = None,
    ps: Iterable[Percent] = DEFAULT_PERCENTILES,
    method: str = "nearest-rank",
    rm: RequestMetrics | None = None,
    fluidity: FluidityTarget | None = None,
) -> Summary:
    """All window statistics of docs/metrics/spec.md for ``batch``.

    ``window`` defaults to :meth:`Window.of` (earliest submit to latest end). Latency
    distributions are over the completed requests (status ok, end in window).
    """
    ps = list(ps)
    w = window or Window.of(batch)
    rm = rm if rm is not None else request_metrics(batch)
    in_win = w.contains(batch.end)
    st = batch.status
    completed = in_win & (st == OK)
    T = w.seconds

    wt = batch.weight  # sampled requests: each counts for 1 / its sampling probability in rates
    n_of = _weighted_count(len(batch), wt)
    tok_in = _tokens_in_window(batch, w, wt)
    counts = _counts(batch, rm, in_win, completed)
    latency = {
        "ttft": Distribution.of(POPULATIONS["ttft"], rm.ttft[completed], ps, method),
        "tpot": Distribution.of(POPULATIONS["tpot"], rm.tpot[completed], ps, method),
        "itl": Distribution.of(POPULATIONS["itl"], rm.itl[completed[rm.itl_request]], ps, method),
        "itl_max": Distribution.of(POPULATIONS["itl_max"], rm.itl_max[completed], ps, method),
        "e2e": Distribution.of(POPULATIONS["e2e"], rm.e2e[completed], ps, method),
    }
    goodput = None if slo is None else _goodput(rm, slo, completed, wt, T)
    flu = None
    if fluidity is not None:
        timed = rm.events > 0 if batch.summarised is None else (rm.events > 0) & ~batch.summarised
        flu = _fluidity(batch, completed & timed, fluidity, ps, method)
    sampling = None
    if wt is not None:
        sampling = {
            "sampled_requests": len(batch),
            "estimated_requests": float(wt.sum()),
            "smallest_probability": float(1.0 / wt.max()) if len(wt) else None,
            "meaning": "each sampled request counts for 1 / its sampling probability in the rates, goodput and "
            "output tokens (estimates); counts and latency distributions are the sample's",
        }
    return Summary(
        sampling=sampling,
        fluidity=flu,
        window=w,
        counts=counts,
        requests_per_s=_rate(n_of(completed), T),
        output_tokens_per_s=_rate(tok_in, T),
        output_tokens_in_window=tok_in,
        percentile_method=method,
        latency=latency,
        goodput=goodput,
        violations=batch.violations,
    )
