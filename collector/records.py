"""What the collector derives: one :class:`RequestRecord` per request and boundary.

Plain data, no I/O (vLLM ``v1/metrics`` style). Points in time are integer Unix **ns** (exact);
durations are float **seconds**; ``None`` where a value is unknown or undefined (TPOT for
N <= 1, never 0).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from otel_llm.timeline import STATUS_CODE, TimelineBatch


@dataclass
class RequestRecord:
    trace_id: str
    boundary: str  # "client" | "engine"
    request_id: str
    model: str
    status: str  # ok | error | cancelled | rejected
    submit_ns: int  # Unix ns. client: sent; engine: arrived at the front end
    end_ns: int  # Unix ns. client: stream closed; engine: finished or aborted
    event_offsets_ns: Sequence[int] = field(default_factory=list)  # token events, ns after submit, ascending
    event_tokens: Sequence[int] = field(default_factory=list)
    input_tokens: int | None = None
    output_tokens: int = 0
    estimated_tokens: bool = False  # client counted tokens itself rather than from usage
    # per-request metrics (spec/metrics.md), filled by derivation
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    itl_max: float | None = None
    # engine internals (engine records; copied onto the paired client record)
    queue: float | None = None  # arrival -> first scheduled
    prefill: float | None = None  # first scheduled -> first token generated
    decode: float | None = None  # first token -> last token generated
    preemptions: int = 0
    preemption_time: float = 0.0  # total seconds preempted
    first_scheduled_ns: int | None = None  # Unix ns
    first_generated_ns: int | None = None  # Unix ns; engine: first token generated (end of prefill)
    engine_delivery: float | None = None  # first token generated -> first output handed out
    # client TTFT decomposition (client records paired with an engine record)
    network_in: float | None = None  # engine arrival - client send
    delivery: float | None = None  # client first token - engine first token generated
    paired: bool = False

    @property
    def submit(self) -> float:
        """Unix seconds."""
        return self.submit_ns / 1e9

    @property
    def end(self) -> float:
        return self.end_ns / 1e9

    @property
    def event_times(self) -> list[float]:
        """Token event times, Unix seconds."""
        return [(self.submit_ns + int(o)) / 1e9 for o in self.event_offsets_ns]

    @property
    def first_event_ns(self) -> int | None:
        return self.submit_ns + int(self.event_offsets_ns[0]) if len(self.event_offsets_ns) else None


def records_to_batch(records: list[RequestRecord], epoch_ns: int = 0) -> TimelineBatch:
    """The records as a timeline batch for the metric core, in seconds after ``epoch_ns``
    (0: Unix seconds; a recent epoch keeps differences exact to well under a nanosecond)."""
    n_ev = [len(r.event_offsets_ns) for r in records]
    submit = np.array([r.submit_ns - epoch_ns for r in records], dtype=np.int64)
    cat = lambda xs: np.concatenate([np.asarray(x, np.int64) for x in xs]) if xs else np.zeros(0, np.int64)  # noqa: E731
    offs = cat([r.event_offsets_ns for r in records])
    return TimelineBatch.from_columns(
        [r.request_id for r in records], submit / 1e9, [(r.end_ns - epoch_ns) / 1e9 for r in records],
        [STATUS_CODE[r.status] for r in records], np.repeat(np.arange(len(records)), n_ev),
        (np.repeat(submit, n_ev) + offs) / 1e9, cat([r.event_tokens for r in records]),
        [-1 if r.input_tokens is None else r.input_tokens for r in records])
