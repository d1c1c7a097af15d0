"""Observation windows ``[W0, W1]`` (seconds, both edges inclusive)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .timeline import TimelineBatch


@dataclass(frozen=True)
class Window:
    start: float  # W0, seconds
    end: float  # W1, seconds
    explicit: bool = False  # given by the user rather than derived from the data

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def contains(self, t: np.ndarray) -> np.ndarray:
        return (t >= self.start) & (t <= self.end)

    @classmethod
    def parse(cls, text: str) -> Window:
        """Parse ``W0,W1`` (seconds on the data's clock)."""
        parts = text.split(",")
        if len(parts) != 2:
            raise ValueError(f"bad window {text!r}: expected W0,W1 in seconds")
        try:
            w0, w1 = float(parts[0]), float(parts[1])
        except ValueError:
            raise ValueError(f"bad window {text!r}: W0 and W1 must be numbers of seconds") from None
        if not w1 > w0:
            raise ValueError(f"bad window {text!r}: W1 must be later than W0")
        return cls(w0, w1, explicit=True)

    @classmethod
    def of(cls, batch: TimelineBatch) -> Window:
        """The default window: earliest submit to latest end (empty batch: [0, 0])."""
        if len(batch) == 0:
            return cls(0.0, 0.0)
        return cls(float(np.min(batch.submit)), float(np.max(batch.end)))
