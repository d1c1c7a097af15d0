"""The timeline model: what one request looked like at one boundary.

All times are in **seconds** on one clock (whatever clock the source used; only differences
matter). A :class:`Timeline` is one request; a :class:`TimelineBatch` is many requests in
columnar (numpy) form, which is what the metric math in :mod:`otel_llm.metrics.request_math` works on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..semconv import Boundary, RequestStatus

#: The statuses of docs/metrics/spec.md, in code order (``TimelineBatch.status`` holds the index).
STATUSES: tuple[str, ...] = RequestStatus.ALL
STATUS_CODE: dict[str, int] = {name: i for i, name in enumerate(STATUSES)}
OK, ERROR, CANCELLED, REJECTED = range(4)

BOUNDARIES: tuple[str, ...] = Boundary.ALL


@dataclass(frozen=True)
class Timeline:
    """One request at one boundary.

    ``submit``: sent (client) or arrived at the engine front end (engine), seconds.
    ``end``: completion observed, seconds; may be later than the last token.
    ``events``: ``(time_s, tokens)`` token events; ``tokens >= 1``. Stored sorted by time.
    """

    id: str
    submit: float
    end: float
    status: str = RequestStatus.OK
    events: tuple[tuple[float, int], ...] = ()
    input_tokens: int | None = None
    attributes: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.status not in STATUS_CODE:
            raise ValueError(f"unknown status {self.status!r} (expected one of {', '.join(STATUSES)})")
        object.__setattr__(self, "events", tuple(sorted((float(t), int(k)) for t, k in self.events)))

    @property
    def output_tokens(self) -> int:
        return sum(k for _, k in self.events)


@dataclass
class TimelineBatch:
    """Many timelines, columnar.

    Request ``i`` owns events ``event_time[offsets[i]:offsets[i+1]]`` (sorted ascending, seconds)
    and ``event_tokens`` likewise. ``status`` holds indices into :data:`STATUSES`.
    """

    ids: list[str]
    submit: np.ndarray  # float64[n], seconds
    end: np.ndarray  # float64[n], seconds
    status: np.ndarray  # int8[n]
    offsets: np.ndarray  # int64[n+1]
    event_time: np.ndarray  # float64[E], seconds
    event_tokens: np.ndarray  # int64[E]
    input_tokens: np.ndarray  # int64[n], -1 where unknown
    # the same times as integers, where the timelines come from the collector's records: the
    # per-request metrics are then computed from them, exactly, whatever else is in the batch
    submit_ns: np.ndarray | None = None  # int64[n], Unix ns
    end_ns: np.ndarray | None = None  # int64[n], Unix ns
    event_offsets_ns: np.ndarray | None = None  # int64[E], ns after the request's submit
    # requests kept by a sampler: each one stands for 1 / (its sampling probability) requests
    # (docs/metrics/spec.md, "Sampling"); None: every request is here, each counts once
    weight: np.ndarray | None = None  # float64[n], >= 1
    # output tokens known without their times (a response that was not streamed: its usage), as
    # observed at the request's end: in N and in token throughput, never a token event (no TTFT)
    untimed_tokens: np.ndarray | None = None  # int64[n]; None: none
    # requests whose token events are their first and last token only (a source that gives TTFT and
    # E2E but does not time each token, e.g. vLLM's own request span): no ITL sample, no largest
    # ITL; TTFT, TPOT (a mean) and N as usual
    summarised: np.ndarray | None = None  # bool[n]; None: none
    # requests whose source does not say how many tokens they gave (a GenAI client span without
    # usage): N unknown (-1 in RequestMetrics.output_tokens), so TPOT too; left out of token
    # throughput, and a TPOT bound is not met, never passed (docs/metrics/spec.md)
    tokens_unknown: np.ndarray | None = None  # bool[n]; None: none
    # where the source checks the timeline invariants (the collector's records): the records that
    # break one, by kind, and "records" in all; None: not checked
    violations: dict[str, int] | None = None

    def __len__(self) -> int:
        return len(self.submit)

    @classmethod
    def empty(cls) -> TimelineBatch:
        return cls(
            [],
            np.zeros(0),
            np.zeros(0),
            np.zeros(0, np.int8),
            np.zeros(1, np.int64),
            np.zeros(0),
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
        )

    @classmethod
    def from_columns(
        cls,
        ids: list[str],
        submit: Sequence[float],
        end: Sequence[float],
        status: Sequence[int],
        event_request: Sequence[int],
        event_time: Sequence[float],
        event_tokens: Sequence[int],
        input_tokens: Sequence[int] | None = None,
    ) -> TimelineBatch:
        """Build from flat columns; events may come in any order (``event_request[j]`` is the
        index of the request that event ``j`` belongs to); see :func:`clean_events`."""
        n = len(ids)
        offsets, et, ek = clean_events(
            np.asarray(event_request, dtype=np.int64),
            np.asarray(event_time, dtype=np.float64),
            np.asarray(event_tokens, dtype=np.int64),
            n,
        )
        it = np.full(n, -1, np.int64) if input_tokens is None else np.asarray(input_tokens, np.int64)
        return cls(
            list(ids),
            np.asarray(submit, np.float64),
            np.asarray(end, np.float64),
            np.asarray(status, np.int8),
            offsets,
            et,
            ek,
            it,
        )

    @classmethod
    def from_timelines(cls, timelines: Iterable[Timeline]) -> TimelineBatch:
        ids, sub, end, st, er, et, ek, it = [], [], [], [], [], [], [], []
        for i, tl in enumerate(timelines):
            ids.append(tl.id)
            sub.append(tl.submit)
            end.append(tl.end)
            st.append(STATUS_CODE[tl.status])
            it.append(-1 if tl.input_tokens is None else tl.input_tokens)
            for t, k in tl.events:
                er.append(i)
                et.append(t)
                ek.append(k)
        return cls.from_columns(ids, sub, end, st, er, et, ek, it)

    def timeline(self, i: int) -> Timeline:
        a, b = self.offsets[i], self.offsets[i + 1]
        return Timeline(
            id=self.ids[i],
            submit=float(self.submit[i]),
            end=float(self.end[i]),
            status=STATUSES[int(self.status[i])],
            events=tuple(zip(self.event_time[a:b].tolist(), self.event_tokens[a:b].tolist())),
            input_tokens=None if self.input_tokens[i] < 0 else int(self.input_tokens[i]),
        )


def clean_events(
    owner: np.ndarray, times: np.ndarray, tokens: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The one place token events are made what the metric math assumes (docs/metrics/spec.md): each
    request's events in time order, every event carrying at least one token (a chunk with none is
    not a token event). ``owner[j]`` is the request (0..n-1) of event ``j``; ``times`` in any unit.
    Events already in (owner, time) order with tokens >= 1 pass through without a copy; otherwise
    a stable sort (equal times keep their order) and a filter.

    Returns ``(start[n + 1], times, tokens)``: request ``i`` owns ``times[start[i]:start[i + 1]]``."""
    if len(times) > 1:
        d_owner = np.diff(owner)
        disorder = (d_owner < 0).any() or ((d_owner == 0) & (np.diff(times) < 0)).any()
    else:
        disorder = False
    if disorder or (tokens <= 0).any():
        order = np.lexsort((times, owner))
        owner, times, tokens = owner[order], times[order], tokens[order]
        keep = tokens > 0
        owner, times, tokens = owner[keep], times[keep], tokens[keep]
    start = np.zeros(n + 1, np.int64)
    if len(owner):
        np.cumsum(np.bincount(owner, minlength=n), out=start[1:])
    return start, times, tokens
