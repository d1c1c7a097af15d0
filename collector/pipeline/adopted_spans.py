"""What the adapters of other engines' own spans (:mod:`collector.pipeline.foreign_spans`) hand derivation:
the batch's spans after them, and what each engine said of each request beyond its request span."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Phases:
    """What an engine's own spans say of one request; None: not said. Durations in ns, moments in
    Unix ns."""

    front_end: int | None = None
    queue: int | None = None
    prefill: int | None = None
    decode: int | None = None
    first_scheduled: int | None = None
    first_generated: int | None = None
    generated: np.ndarray | None = None  # Unix ns of each token generated (int64), in order


@dataclass
class Adopted:
    """A batch's spans after the adapters: ``summarised`` marks the request spans whose token events
    are the first and last token only; ``phases`` is keyed by (trace index, span id)."""

    flat: list[tuple]
    codes: np.ndarray
    tix: np.ndarray
    summarised: np.ndarray
    phases: dict[tuple[int, bytes], Phases]
