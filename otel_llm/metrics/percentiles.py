"""Percentiles: exact nearest rank (the default) and linear interpolation (numpy's default).

``p`` is in percent, ``0 <= p <= 100``. Nearest rank takes the sample at 1-based rank
``ceil(p * n / 100)`` (at least 1), computed with exact rational arithmetic from the decimal
text of ``p`` so that no floating-point rounding moves the rank (p = 7, n = 100 is rank 7).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from fractions import Fraction

import numpy as np

METHODS = ("nearest-rank", "linear")
Percent = int | float | str | Fraction


def as_fraction(p: Percent) -> Fraction:
    """The exact value of a percent given as text or number (floats through their shortest repr)."""
    if isinstance(p, Fraction):
        f = p
    elif isinstance(p, float):
        f = Fraction(repr(p))
    else:
        f = Fraction(str(p).strip())
    if not 0 <= f <= 100:
        raise ValueError(f"percentile {p} is outside [0, 100]")
    return f


def nearest_rank_index(p: Percent, n: int) -> int:
    """0-based index of the nearest-rank p-th percentile among ``n`` sorted samples."""
    if n <= 0:
        raise ValueError("no samples")
    rank = math.ceil(as_fraction(p) * n / 100)
    return min(max(rank, 1), n) - 1


def percentiles(
    samples: np.ndarray, ps: Iterable[Percent], method: str = "nearest-rank", presorted: bool = False
) -> list[float | None]:
    """The percentiles ``ps`` of ``samples`` (any order, or ascending with ``presorted``);
    ``None`` for each when there are none."""
    ps = list(ps)
    x = np.asarray(samples, dtype=np.float64)
    if not presorted:
        x = np.sort(x)
    n = len(x)
    if n == 0:
        return [None] * len(ps)
    if method == "nearest-rank":
        return [float(x[nearest_rank_index(p, n)]) for p in ps]
    if method == "linear":
        return [float(np.percentile(x, float(as_fraction(p)), method="linear")) for p in ps]
    raise ValueError(f"unknown percentile method {method!r} (expected one of {', '.join(METHODS)})")


def percentile_key(p: Percent) -> str:
    """The JSON key of a percentile: ``p50``, ``p99.9``, ``p7`` (``"p%g"``)."""
    return f"p{float(as_fraction(p)):g}"
