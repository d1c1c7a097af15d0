"""The fluidity index (Etalon; Agrawal et al., 2024): how much of a stream a reader got on time.

Every output token has a deadline: the first ``ttft`` after submit, each later one ``tbt`` after
the one before. A token that comes early banks the time it saved (slack), which later tokens may
spend; a token that comes late misses its own deadline and those of the tokens that would have
come in the meantime (one per ``tbt`` of lateness), and the schedule restarts from it with no
slack. fluidity = 1 - missed deadlines / deadlines. docs/metrics/fluidity.md has the definition in
words and a worked example; the arithmetic here is integer ns, so it is exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FluidityTarget:
    """Deadlines (seconds), the index a request must reach to count as fluid, and the share of
    requests that must be fluid for the fluid token generation rate (Etalon's 99%)."""

    ttft: float
    tbt: float
    target: float = 0.9
    share: float = 0.99

    @classmethod
    def parse(cls, text: str) -> FluidityTarget:
        """``ttft=S,tbt=S[,target=F][,share=F]`` (seconds; fractions, default 0.9 and 0.99)."""
        vals: dict[str, float] = {}
        for part in text.split(","):
            k, sep, v = part.strip().partition("=")
            if not sep or k not in ("ttft", "tbt", "target", "share"):
                raise ValueError(f"{part.strip()!r}: expected ttft=S, tbt=S and optionally target=F, share=F")
            try:
                vals[k] = float(v)
            except ValueError:
                raise ValueError(f"{k}={v!r} is not a number") from None
        if "ttft" not in vals or "tbt" not in vals:
            raise ValueError("both ttft= and tbt= deadlines are needed")
        target, share = vals.get("target", 0.9), vals.get("share", 0.99)
        if vals["ttft"] < 0 or vals["tbt"] <= 0 or not 0 <= target <= 1 or not 0 < share <= 1:
            raise ValueError("ttft >= 0, tbt > 0, 0 <= target <= 1 and 0 < share <= 1")
        return cls(vals["ttft"], vals["tbt"], target, share)


def deadline_misses(offsets_ns: Sequence[int], tokens: Sequence[int], ttft_ns: int, tbt_ns: int) -> tuple[int, int]:
    """(missed, total) deadlines of one request whose token events came ``offsets_ns`` after its
    submit (ascending) carrying ``tokens`` each. The tokens of one event after its first arrive with
    no gap (each meets its deadline and banks ``tbt``). Deadlines in ns, ``tbt_ns`` > 0."""
    missed = total = slack = prev = 0
    first = True
    for t, k in zip(offsets_ns, tokens):
        if k <= 0:
            continue
        gap, prev = t - prev, t
        due = ttft_ns if first else tbt_ns
        if gap <= due + slack:
            slack += due - gap
            total += 1
        else:
            late = (gap - slack - due) // tbt_ns + 1 if first else (gap - slack) // tbt_ns
            missed += late
            total += late
            slack = 0
        first = False
        if k > 1:  # the rest of the event: on time, each banking a whole tbt
            slack += (k - 1) * tbt_ns
            total += k - 1
    return missed, total


def fluidity_index(offsets_ns: Sequence[int], tokens: Sequence[int], ttft_ns: int, tbt_ns: int) -> float | None:
    """1 - missed / total deadlines of one request (None without a token)."""
    missed, total = deadline_misses(offsets_ns, tokens, ttft_ns, tbt_ns)
    return 1.0 - missed / total if total else None


def miss_rates(
    offsets: np.ndarray, event_offsets_ns: np.ndarray, event_tokens: np.ndarray, which: np.ndarray, t: FluidityTarget
) -> np.ndarray:
    """Per request in ``which`` (indices): missed / total deadlines (NaN without a token).
    Request ``i`` owns the events ``offsets[i]:offsets[i + 1]``, in ns after its submit."""
    ttft_ns, tbt_ns = round(t.ttft * 1e9), round(t.tbt * 1e9)
    out = np.full(len(which), np.nan)
    offs, toks, st = event_offsets_ns.tolist(), event_tokens.tolist(), offsets.tolist()
    for j, i in enumerate(which.tolist()):
        a, b = st[i], st[i + 1]
        missed, total = deadline_misses(offs[a:b], toks[a:b], ttft_ns, tbt_ns)
        if total:
            out[j] = missed / total
    return out


def _fluid_share(st: list, offs: list, toks: list, which: list, ttft_ns: int, tbt_ns: int, target: float) -> float:
    fluid = 0
    for i in which:
        a, b = st[i], st[i + 1]
        missed, total = deadline_misses(offs[a:b], toks[a:b], ttft_ns, tbt_ns)
        fluid += total > 0 and 1.0 - missed / total >= target
    return fluid / len(which)


def fluid_token_rate(
    offsets: np.ndarray, event_offsets_ns: np.ndarray, event_tokens: np.ndarray, which: np.ndarray, t: FluidityTarget
) -> float | None:
    """Etalon's fluid token generation rate (tokens/s): 1 / the smallest per-token deadline ``tbt``
    at which a share ``t.share`` of the requests in ``which`` reach index ``t.target``, keeping the
    TTFT deadline ``t.ttft``. None when no ``tbt`` does (the first tokens alone are too late) or
    ``which`` is empty; ``math.inf`` when any does, down to 1 us (the slack the first token banked
    covers every later one). A larger ``tbt`` moves every deadline later, so the share only grows
    with it: bisection on a log scale, to 0.1%."""
    if len(which) == 0:
        return None
    st, offs, toks, w = offsets.tolist(), event_offsets_ns.tolist(), event_tokens.tolist(), which.tolist()
    ttft_ns = round(t.ttft * 1e9)
    gaps = np.diff(event_offsets_ns) if len(event_offsets_ns) > 1 else np.zeros(1, np.int64)
    hi = int(max(int(gaps.max(initial=0)), 1)) + 1  # every later token on time: only the TTFT can fail
    if _fluid_share(st, offs, toks, w, ttft_ns, hi, t.target) < t.share:
        return None
    lo = 1_000  # 1 us: no stream is that fast
    if _fluid_share(st, offs, toks, w, ttft_ns, lo, t.target) >= t.share:
        return math.inf
    while hi > lo * 1.001 and hi - lo > 1:  # share(lo) < t.share <= share(hi)
        mid = round((lo * hi) ** 0.5)
        if _fluid_share(st, offs, toks, w, ttft_ns, mid, t.target) >= t.share:
            hi = mid
        else:
            lo = mid
    return 1e9 / hi
