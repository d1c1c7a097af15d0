"""What the collector derives: one :class:`RequestRecord` per request and boundary.

Plain data, no I/O (vLLM ``v1/metrics`` style). Points in time are integer Unix **ns** (exact);
durations are float **seconds**; ``None`` where a value is unknown or undefined (TPOT for
N <= 1, never 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
    peer_request_id: str | None = None  # the request id of the paired record at the other boundary

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


def _concat(arrays: list) -> np.ndarray:
    """Many int sequences as one int64 array."""
    return np.concatenate([np.asarray(x, np.int64) for x in arrays]) if arrays else np.zeros(0, np.int64)


def records_to_batch(records: list[RequestRecord], epoch_ns: int = 0) -> TimelineBatch:
    """The records as a timeline batch for the metric core, in seconds after ``epoch_ns``
    (0: Unix seconds; a recent epoch keeps differences exact to well under a nanosecond)."""
    n_ev = [len(r.event_offsets_ns) for r in records]
    submit = np.array([r.submit_ns - epoch_ns for r in records], dtype=np.int64)
    offs = _concat([r.event_offsets_ns for r in records])
    return TimelineBatch.from_columns(
        [r.request_id for r in records],
        submit / 1e9,
        [(r.end_ns - epoch_ns) / 1e9 for r in records],
        [STATUS_CODE[r.status] for r in records],
        np.repeat(np.arange(len(records)), n_ev),
        (np.repeat(submit, n_ev) + offs) / 1e9,
        _concat([r.event_tokens for r in records]),
        [-1 if r.input_tokens is None else r.input_tokens for r in records],
    )


NO_NS = np.iinfo(np.int64).min  # an unknown point in time in an int64 ns column


def _opt(values: np.ndarray) -> list:
    """A float column as Python values, None for NaN."""
    return [None if v != v else v for v in values.tolist()]


def _opt_ns(values: np.ndarray) -> list:
    return [None if v == NO_NS else v for v in values.tolist()]


@dataclass
class RecordBatch:
    """Many :class:`RequestRecord` s, columnar: what derivation produces and the store and the
    metrics registry consume. Record ``i``'s token events are ``event_offsets_ns[event_start[i]:
    event_start[i + 1]]`` (ns after submit, ascending) and ``event_tokens`` likewise; unknown
    values are NaN (float seconds), :data:`NO_NS` (int64 ns) or -1 (input tokens)."""

    trace_id: list[str]
    boundary: list[str]
    request_id: list[str]
    model: list[str]
    status: list[str]
    submit_ns: np.ndarray  # int64, Unix ns
    end_ns: np.ndarray  # int64, Unix ns
    event_start: np.ndarray  # int64[n + 1]
    event_offsets_ns: np.ndarray  # int64
    event_tokens: np.ndarray  # int64
    input_tokens: np.ndarray  # int64, -1 unknown
    output_tokens: np.ndarray  # int64
    estimated_tokens: np.ndarray  # bool
    ttft: np.ndarray  # float seconds
    tpot: np.ndarray
    e2e: np.ndarray
    itl_max: np.ndarray
    queue: np.ndarray
    prefill: np.ndarray
    decode: np.ndarray
    preemptions: np.ndarray  # int64
    preemption_time: np.ndarray  # float seconds
    first_scheduled_ns: np.ndarray  # int64, NO_NS unknown
    first_generated_ns: np.ndarray
    engine_delivery: np.ndarray
    network_in: np.ndarray
    delivery: np.ndarray
    paired: np.ndarray  # bool
    peer_request_id: list  # str, None where unpaired

    def __len__(self) -> int:
        return len(self.trace_id)

    def scalar_columns(self, nan_as_none: bool = True) -> dict[str, list]:
        """Every scalar field of :class:`RequestRecord`, as Python values (None where unknown).
        ``nan_as_none=False`` leaves unknown float seconds as NaN (SQLite stores a NaN as NULL)."""
        f = _opt if nan_as_none else (lambda a: a.tolist())
        return {
            "trace_id": self.trace_id,
            "boundary": self.boundary,
            "request_id": self.request_id,
            "model": self.model,
            "status": self.status,
            "submit_ns": self.submit_ns.tolist(),
            "end_ns": self.end_ns.tolist(),
            "input_tokens": [None if v < 0 else v for v in self.input_tokens.tolist()],
            "output_tokens": self.output_tokens.tolist(),
            "estimated_tokens": self.estimated_tokens.tolist(),
            "ttft": f(self.ttft),
            "tpot": f(self.tpot),
            "e2e": f(self.e2e),
            "itl_max": f(self.itl_max),
            "queue": f(self.queue),
            "prefill": f(self.prefill),
            "decode": f(self.decode),
            "preemptions": self.preemptions.tolist(),
            "preemption_time": self.preemption_time.tolist(),
            "first_scheduled_ns": _opt_ns(self.first_scheduled_ns),
            "first_generated_ns": _opt_ns(self.first_generated_ns),
            "engine_delivery": f(self.engine_delivery),
            "network_in": f(self.network_in),
            "delivery": f(self.delivery),
            "paired": self.paired.tolist(),
            "peer_request_id": self.peer_request_id,
        }

    @classmethod
    def from_records(cls, records: Sequence[RequestRecord]) -> RecordBatch:
        """The inverse of :meth:`records`."""
        f = lambda name, none, dtype: np.array(
            [none if getattr(r, name) is None else getattr(r, name) for r in records],
            dtype,
        )
        counts = [len(r.event_offsets_ns) for r in records]
        start = np.zeros(len(records) + 1, np.int64)
        np.cumsum(counts, out=start[1:])
        return cls(
            trace_id=[r.trace_id for r in records],
            boundary=[r.boundary for r in records],
            request_id=[r.request_id for r in records],
            model=[r.model for r in records],
            status=[r.status for r in records],
            submit_ns=f("submit_ns", 0, np.int64),
            end_ns=f("end_ns", 0, np.int64),
            event_start=start,
            event_offsets_ns=_concat([r.event_offsets_ns for r in records]),
            event_tokens=_concat([r.event_tokens for r in records]),
            input_tokens=f("input_tokens", -1, np.int64),
            output_tokens=f("output_tokens", 0, np.int64),
            estimated_tokens=f("estimated_tokens", False, bool),
            **{
                k: f(k, np.nan, np.float64)
                for k in (
                    "ttft",
                    "tpot",
                    "e2e",
                    "itl_max",
                    "queue",
                    "prefill",
                    "decode",
                    "preemption_time",
                    "engine_delivery",
                    "network_in",
                    "delivery",
                )
            },
            preemptions=f("preemptions", 0, np.int64),
            first_scheduled_ns=f("first_scheduled_ns", NO_NS, np.int64),
            first_generated_ns=f("first_generated_ns", NO_NS, np.int64),
            paired=f("paired", False, bool),
            peer_request_id=[r.peer_request_id for r in records],
        )

    def records(self) -> list[RequestRecord]:
        cols = self.scalar_columns()
        names = list(cols)
        out = []
        st = self.event_start.tolist()
        for i, values in enumerate(zip(*cols.values())):
            a, b = st[i], st[i + 1]
            out.append(
                RequestRecord(
                    **dict(zip(names, values)),
                    event_offsets_ns=self.event_offsets_ns[a:b],
                    event_tokens=self.event_tokens[a:b],
                )
            )
        return out
