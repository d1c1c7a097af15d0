"""Load sweeps and the capacity search (docs/metrics/capacity.md). Pure functions and plain state;
the runs themselves are :mod:`otel_llm.bench.bench_sweep`'s.

* :class:`Sweep`: ``rate=1,2,4,8``, ``concurrency=1,4,16`` or a geometric ``rate=geom:1:16:5``.
* Capacity at an SLO (DistServe's goodput capacity): the largest request rate (requests/s) at which
  at least a share ``attainment`` of the requests sent meet every bound of the SLO. A request that
  failed, was cancelled or was rejected did not meet it (unlike the spec's SLO attainment, which is
  over completed requests only: at overload, refusing work must not look like meeting the SLO).
* How many requests a point needs: enough that a Wilson score interval at the target share is no
  wider than ``+-error`` at ``confidence`` (:func:`requests_per_point`); each point reports its own
  interval (:func:`wilson`). The interval treats requests as independent draws; requests queued
  behind each other are not, so a point's real uncertainty can be wider (say so with the answer).
* A point's steady state (:func:`keeping_up`): over its measured window, the server completes
  what it is sent (within the sampling error of the count sent) and the number in flight does not
  grow; a point whose server falls behind fails, whatever its few measured requests met.
* :class:`CapacitySearch`: bracketing, then bisection on a log scale, stopped when the bracket is
  within ``resolution`` (relative), at the rate bounds, or after ``max_points`` points.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

KNOBS = ("rate", "concurrency")


@dataclass(frozen=True)
class Sweep:
    """The load points of ``--sweep``: requests/s (open loop) or workers (closed loop)."""

    knob: str
    values: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> Sweep:
        """``rate=1,2,4,8``, ``concurrency=1,4,16`` or ``KNOB=geom:LO:HI:N`` (N points, LO to HI,
        a constant ratio apart)."""
        knob, sep, rest = text.strip().partition("=")
        knob = knob.strip()
        if not sep or knob not in KNOBS:
            raise ValueError(f"{text!r}: expected rate=V,V,... or concurrency=V,V,... (or KNOB=geom:LO:HI:N)")
        if rest.startswith("geom:"):
            parts = rest.split(":")[1:]
            if len(parts) != 3:
                raise ValueError(f"{text!r}: the geometric form is {knob}=geom:LO:HI:N")
            try:
                lo, hi, n = float(parts[0]), float(parts[1]), int(parts[2])
            except ValueError:
                raise ValueError(f"{text!r}: LO and HI are numbers, N an integer") from None
            if not (0 < lo < hi and math.isfinite(hi)) or n < 2:
                raise ValueError(f"{text!r}: needs 0 < LO < HI and N >= 2")
            values = [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
        else:
            try:
                values = [float(v) for v in rest.split(",") if v.strip()]
            except ValueError:
                raise ValueError(f"{text!r}: the values are numbers, comma-separated") from None
        if not values or not all(math.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"{text!r}: every value must be > 0")
        if knob == "concurrency":
            values = [float(max(1, round(v))) for v in values]
        else:
            values = [float(f"{v:.4g}") for v in values]
        values = sorted(set(values))
        return cls(knob, tuple(values))

    def label(self, value: float) -> str:
        """How a point is named in its run id: ``rate4``, ``rate0.5``, ``concurrency16``."""
        return f"{self.knob}{value:g}"


def _z(confidence: float) -> float:
    return NormalDist().inv_cdf(1 - (1 - confidence) / 2)


def wilson(good: int, n: int, confidence: float = 0.95) -> tuple[float, float] | None:
    """The Wilson score interval of a share ``good / n`` at ``confidence`` (None when n = 0)."""
    if n <= 0:
        return None
    z, p = _z(confidence), good / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    lo = 0.0 if good <= 0 else max(0.0, centre - half)  # exact at the ends (no rounding residue)
    hi = 1.0 if good >= n else min(1.0, centre + half)
    return lo, hi


def wilson_half_width(share: float, n: int, confidence: float = 0.95) -> float:
    """Half the width of the Wilson interval of ``n`` draws whose share is ``share``."""
    z = _z(confidence)
    return z / (1 + z * z / n) * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n))


def requests_per_point(attainment: float, error: float, confidence: float = 0.95) -> int:
    """The fewest requests whose Wilson interval, at a share equal to the target ``attainment``, is
    within ``+-error`` at ``confidence``: near the target, where the verdict is decided, the point
    then knows which side it is on to that error."""
    if not 0 < error < 0.5 or not 0 < attainment <= 1 or not 0 < confidence < 1:
        raise ValueError("needs 0 < error < 0.5, 0 < attainment <= 1 and 0 < confidence < 1")
    n = 1
    while wilson_half_width(attainment, n, confidence) > error:
        n = n * 2 if wilson_half_width(attainment, n * 2, confidence) > error else n + 1
    return n


@dataclass
class Point:
    """One measured rate of a capacity search and its verdict."""

    rate: float  # requests/s, nominal
    passed: bool  # the attainment over requests sent reached the target
    attainment: float | None = None
    interval: tuple[float, float] | None = None  # Wilson, at the search's confidence
    clear: bool = False  # the interval lies wholly on the verdict's side of the target (else marginal)


@dataclass
class CapacitySearch:
    """Bracket the capacity by multiplying (or dividing) the rate by ``factor``, then bisect the
    bracket at its geometric mean until ``hi / lo <= 1 + resolution``. Rates in requests/s.

    Stops (``stopped``, a reason): ``bracketed``; ``passed at max rate``; ``failed at min rate``;
    ``max points``. The answer is ``capacity``: the largest rate that passed below the smallest one
    that failed (a pass above a fail, from noise, does not move it)."""

    start: float = 1.0
    resolution: float = 0.1
    min_rate: float = 0.01
    max_rate: float = 1000.0
    max_points: int = 12
    factor: float = 2.0
    target: float = 0.9
    points: list[Point] = field(default_factory=list)
    stopped: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.min_rate <= self.start <= self.max_rate:
            raise ValueError("needs 0 < min rate <= start <= max rate")
        if not self.resolution >= 0.001:
            raise ValueError("the resolution is a fraction >= 0.001")
        if self.max_points < 1 or self.factor <= 1:
            raise ValueError("needs max points >= 1 and factor > 1")

    @property
    def lowest_failing(self) -> float | None:
        fails = [p.rate for p in self.points if not p.passed]
        return min(fails) if fails else None

    @property
    def capacity(self) -> float | None:
        hi = self.lowest_failing
        ok = [p.rate for p in self.points if p.passed and (hi is None or p.rate < hi)]
        return max(ok) if ok else None

    def record(self, rate: float, passed: bool, attainment: float | None = None, interval=None) -> Point:
        clear = interval is not None and (interval[0] >= self.target if passed else interval[1] < self.target)
        p = Point(rate, passed, attainment, interval, clear)
        self.points.append(p)
        return p

    def next_rate(self) -> float | None:
        """The next rate to measure, or None (then ``stopped`` says why)."""
        if self.stopped:
            return None
        if not self.points:
            return self.start
        lo, hi = self.capacity, self.lowest_failing
        nxt = None
        if len(self.points) >= self.max_points:
            self.stopped = "max points"
        elif hi is None:
            if lo >= self.max_rate:
                self.stopped = "passed at max rate"
            else:
                nxt = min(lo * self.factor, self.max_rate)
        elif lo is None:
            if hi <= self.min_rate:
                self.stopped = "failed at min rate"
            else:
                nxt = max(hi / self.factor, self.min_rate)
        elif hi / lo <= 1 + self.resolution:
            self.stopped = "bracketed"
        else:
            nxt = math.sqrt(lo * hi)
        return None if nxt is None else float(f"{nxt:.4g}")


def first_failed_bound(points: list[dict], target: float) -> tuple[float, list[str]] | None:
    """Over ``points`` ({"rate": r, "by_bound": {bound: share}}) in order of load: the first load at
    which a bound's share fell below ``target``, and the bounds below it there, worst first."""
    for p in sorted(points, key=lambda p: p["rate"]):
        low = sorted((v, k) for k, v in (p.get("by_bound") or {}).items() if v is not None and v < target)
        if low:
            return p["rate"], [k for _, k in low]
    return None


def part_that_grew(low: dict[str, float], high: dict[str, float]) -> tuple[str, float] | None:
    """Of the mean TTFT parts (seconds) at a low load and at the knee: the part that grew the most
    and by how much (seconds). None when no part is known at both."""
    grew = [(high[k] - low[k], k) for k in high if k in low and high[k] is not None and low[k] is not None]
    if not grew:
        return None
    d, k = max(grew)
    return k, d


@dataclass(frozen=True)
class KeepingUp:
    """Whether the server kept up with a point's offered load over the point's measured window
    (after its settling time). Rates in requests/s, times in seconds.

    In a steady state every request sent is eventually completed at the rate it was sent, and the
    number in flight (sent, not yet ended) stays bounded. A server that does not keep up completes
    fewer than it is sent, and the number in flight grows for as long as the point lasts."""

    window_s: float
    sent: int  # requests sent in the window
    offered_per_s: float  # sent / window_s
    completed_per_s: float  # requests that ended in the window (whenever they were sent) / window_s
    in_flight_start: int  # at the window's start
    in_flight_end: int  # at its end
    trend_per_s: float  # least-squares slope of the number in flight over the window
    tolerance_per_s: float  # z * sqrt(sent) / window_s: the sampling error of a Poisson count of sent
    growth: float  # the mean number in flight over the window's last quarter minus that over its first
    growth_tolerance: float  # z * sqrt(2) * its spread within those quarters; at least 2 and 2% of sent
    keeps_up: bool  # offered - completed <= tolerance_per_s, and growth <= growth_tolerance

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def keeping_up(
    send_s: Sequence[float], end_s: Sequence[float], start: float, stop: float, confidence: float = 0.95
) -> KeepingUp | None:
    """Did the server keep up over ``[start, stop)`` (seconds, one clock)? ``send_s``/``end_s`` are
    every request's send and end times (the settling requests' too: they end in the window).

    Falling behind = completions in the window fall short of the requests sent in it by more than
    ``z * sqrt(sent)`` (the Poisson sampling error of the count sent, at ``confidence``): a server
    that keeps up completes what it is sent, give or take what is in flight at the two ends; or the
    number in flight grows through the window: its mean over the window's last quarter exceeds that
    over its first (sampled at 64 times) by more than ``z * sqrt(2)`` times its spread within those
    quarters (what two stretches of a settled queue differ by), and by more than 2 requests and 2%
    of those sent in the window (less is within any search's resolution). A queue that swelled and
    drained within the window kept up. None when the window is empty."""
    send, end = np.asarray(send_s, float), np.asarray(end_s, float)
    w = stop - start
    sent = int(((send >= start) & (send < stop)).sum())
    if w <= 0 or sent == 0:
        return None
    done = int(((end >= start) & (end < stop)).sum())
    grid = np.linspace(start, stop, 64)
    flight = np.searchsorted(np.sort(send), grid, "right") - np.searchsorted(np.sort(end), grid, "right")
    slope = np.polyfit(grid - start, flight, 1)[0]
    first, last = flight[:16], flight[-16:]
    spread = math.sqrt((np.var(first) + np.var(last)) / 2)
    z = _z(confidence)
    tol = z * math.sqrt(sent) / w
    growth, growth_tol = float(last.mean() - first.mean()), max(z * math.sqrt(2) * spread, 2.0, 0.02 * sent)
    return KeepingUp(
        window_s=w,
        sent=sent,
        offered_per_s=sent / w,
        completed_per_s=done / w,
        in_flight_start=int(flight[0]),
        in_flight_end=int(flight[-1]),
        trend_per_s=float(slope),
        tolerance_per_s=tol,
        growth=growth,
        growth_tolerance=growth_tol,
        keeps_up=(sent - done) / w <= tol and growth <= growth_tol,
    )
