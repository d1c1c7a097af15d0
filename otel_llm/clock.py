"""Clocks: monotonic ns for durations, one wall-clock anchor per process to place spans in time."""

from __future__ import annotations

import time

monotonic_ns = time.monotonic_ns  # CLOCK_MONOTONIC: system-wide on Linux, so comparable across processes


class WallAnchor:
    """Converts this host's monotonic clock to wall-clock ns with one anchor taken at creation."""

    __slots__ = ("offset_ns",)

    def __init__(self) -> None:
        # bracket the wall-clock read with two monotonic reads to halve the error
        m0 = time.monotonic_ns()
        w = time.time_ns()
        m1 = time.monotonic_ns()
        self.offset_ns = w - (m0 + m1) // 2

    def wall_ns(self, mono_ns: int) -> int:
        return mono_ns + self.offset_ns

    def wall_ns_from_mono_s(self, mono_s: float) -> int:
        return int(mono_s * 1e9) + self.offset_ns
