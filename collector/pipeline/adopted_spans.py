"""What the adapters of other engines' own spans (:mod:`collector.pipeline.foreign_spans`) hand derivation:
the batch's spans after them, and what each engine said of each request beyond its request span."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import walked_span as sp


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


OUTSIDE = "phase_outside_request"  # the invariants' kind (collector/pipeline/invariants.py)
_DURATIONS = ("front_end", "queue", "prefill", "decode")


def within(ph: Phases, start: int, end: int) -> tuple[Phases, bool]:
    """``ph`` with what cannot lie inside its request span ``[start, end]`` (Unix ns) made unknown:
    a negative duration or one longer than the span, a moment outside it, generation times outside
    it, and every duration where together they exceed the span. True where anything was: an
    engine's own account that its request span contradicts is unknown, never stored or exported."""
    span = end - start
    out = Phases(**vars(ph))
    bad = False
    for f in _DURATIONS:
        v = getattr(out, f)
        if v is not None and not 0 <= v <= span:
            setattr(out, f, None)
            bad = True
    for f in ("first_scheduled", "first_generated"):
        v = getattr(out, f)
        if v is not None and not start <= v <= end:
            setattr(out, f, None)
            bad = True
    g = out.generated
    if g is not None and len(g) and (int(g.min()) < start or int(g.max()) > end):
        out.generated = None
        bad = True
    if sum(getattr(out, f) or 0 for f in _DURATIONS) > max(span, 0):
        for f in _DURATIONS:
            setattr(out, f, None)
        bad = True
    return out, bad


def flag_outside(row: list) -> None:
    """Say on a walked request span (a list, being adopted) that its engine's phases broke out of it."""
    said = row[sp.VIOLATIONS]
    kinds = set(said.split(",")) if type(said) is str and said else set()
    row[sp.VIOLATIONS] = ",".join(sorted(kinds | {OUTSIDE}))


@dataclass
class Adopted:
    """A batch's spans after the adapters: ``summarised`` marks the request spans whose token events
    are the first and last token only; ``phases`` is keyed by (trace index, span id)."""

    flat: list[tuple]
    codes: np.ndarray
    tix: np.ndarray
    summarised: np.ndarray
    phases: dict[tuple[int, bytes], Phases]
