"""Observation windows ``[W0, W1]`` (seconds, both edges inclusive)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .timeline import TimelineBatch

#: Times below this many seconds are not Unix times (it is 2001-09-09): on data whose clock is Unix
#: time (a store, a trace file), a window given in such numbers is relative to the data's start.
UNIX_EPOCH_LIMIT_S = 1e9


@dataclass(frozen=True)
class Window:
    start: float  # W0, seconds
    end: float  # W1, seconds
    explicit: bool = False  # given by the user rather than derived from the data

    @property
    def on_unix_clock(self) -> bool:
        return self.start >= UNIX_EPOCH_LIMIT_S

    @property
    def relative(self) -> bool:
        """Given in seconds too small to be Unix times (see :data:`UNIX_EPOCH_LIMIT_S`)."""
        return self.explicit and self.end < UNIX_EPOCH_LIMIT_S

    def after(self, origin_s: float) -> Window:
        """This window, its edges taken as seconds after ``origin_s``."""
        return Window(origin_s + self.start, origin_s + self.end, self.explicit)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def contains(self, t: np.ndarray) -> np.ndarray:
        return (t >= self.start) & (t <= self.end)

    @classmethod
    def parse(cls, text: str) -> Window:
        """Parse ``W0,W1``: seconds on the data's clock, or ISO 8601 times (Unix clock)."""
        from .selection import parse_time

        parts = text.split(",")
        if len(parts) != 2:
            raise ValueError(f"bad window {text!r}: expected W0,W1 in seconds or ISO 8601 times")

        def edge(p: str) -> float:
            try:
                return float(p)  # seconds, exactly as written
            except ValueError:
                return parse_time(p) / 1e9  # an ISO 8601 time

        try:
            w0, w1 = edge(parts[0]), edge(parts[1])
        except ValueError:
            raise ValueError(f"bad window {text!r}: W0 and W1 must be numbers of seconds or ISO 8601 times") from None
        if not w1 > w0:
            raise ValueError(f"bad window {text!r}: W1 must be later than W0")
        return cls(w0, w1, explicit=True)

    @classmethod
    def of(cls, batch: TimelineBatch) -> Window:
        """The default window: earliest submit to latest end (empty batch: [0, 0])."""
        if len(batch) == 0:
            return cls(0.0, 0.0)
        return cls(float(np.min(batch.submit)), float(np.max(batch.end)))
