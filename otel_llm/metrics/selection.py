"""Which derived records a reader keeps: a run, a service, a trace, a span of time, warm-ups or not.

A store accumulates every run it is sent; :class:`Selection` picks the ones a summary is about.
Times are Unix ns on the records' clocks (client: the client host's; engine: the engine host's),
compared with each record's submit time."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone


@dataclass(frozen=True)
class Selection:
    runs: tuple[str, ...] = ()  # llm.bench.run_id values; empty: every run (and records of none)
    services: tuple[str, ...] = ()  # service.name values; empty: every service
    since_ns: int | None = None  # keep submit >= this (Unix ns)
    until_ns: int | None = None  # keep submit <= this
    include_warmup: bool = False  # warm-up requests are left out unless asked for
    traces: tuple[str, ...] = ()  # trace ids, 32 lowercase hex digits; empty: every trace

    def describe(self) -> dict:
        """What was selected, for a summary's conditions (JSON-ready)."""
        d: dict = {"warmup": "included" if self.include_warmup else "excluded"}
        if self.runs:
            d["runs"] = list(self.runs)
        if self.services:
            d["services"] = list(self.services)
        if self.traces:
            d["traces"] = list(self.traces)
        if self.since_ns is not None:
            d["since"] = iso(self.since_ns / 1e9)
        if self.until_ns is not None:
            d["until"] = iso(self.until_ns / 1e9)
        return d


def parse_time(text: str) -> int:
    """A point in time as Unix ns: ISO 8601 (``2026-12-01T09:30:00Z``, ``2026-12-01 09:30``; no zone:
    local time) or Unix seconds (``1796109426.9``). ValueError otherwise."""
    t = text.strip()
    try:
        x = float(t)
    except ValueError:
        try:
            dt = datetime.fromisoformat(t.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise ValueError(f"bad time {text!r}: expected ISO 8601 (2026-12-01T09:30:00Z) or Unix seconds") from None
        return round(dt.timestamp() * 1e9)  # naive: local time (datetime.timestamp's rule)
    if not math.isfinite(x):
        raise ValueError(f"bad time {text!r}")
    return round(x * 1e9)


def iso(unix_s: float) -> str:
    """Unix seconds as ISO 8601 UTC, to the microsecond: ``2026-12-01T09:30:00.123456Z``."""
    return datetime.fromtimestamp(unix_s, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
