"""The timeline model: what one request looked like at one boundary.

All times are in **seconds** on one clock (whatever clock the source used; only differences
matter). A :class:`Timeline` is one request; a :class:`TimelineBatch` is many requests in
columnar (numpy) form, which is what the metric math in :mod:`otel_llm.metrics` works on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

#: The statuses of spec/metrics.md, in code order (``TimelineBatch.status`` holds the index).
STATUSES: tuple[str, ...] = ("ok", "error", "cancelled", "rejected")
STATUS_CODE: dict[str, int] = {name: i for i, name in enumerate(STATUSES)}
OK, ERROR, CANCELLED, REJECTED = range(4)

BOUNDARIES: tuple[str, ...] = ("client", "engine")


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
    status: str = "ok"
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
        index of the request that event ``j`` belongs to). Sorts events by (request, time)."""
        n = len(ids)
        req = np.asarray(event_request, dtype=np.int64)
        et = np.asarray(event_time, dtype=np.float64)
        ek = np.asarray(event_tokens, dtype=np.int64)
        order = np.lexsort((et, req))
        req, et, ek = req[order], et[order], ek[order]
        counts = np.bincount(req, minlength=n) if len(req) else np.zeros(n, np.int64)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
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

    @staticmethod
    def concat(batches: Sequence[TimelineBatch]) -> TimelineBatch:
        if not batches:
            return TimelineBatch.empty()
        ids: list[str] = []
        offs = [np.zeros(1, np.int64)]
        base = 0
        for b in batches:
            ids.extend(b.ids)
            offs.append(b.offsets[1:] + base)
            base += int(b.offsets[-1])
        cat = np.concatenate
        return TimelineBatch(
            ids,
            cat([b.submit for b in batches]),
            cat([b.end for b in batches]),
            cat([b.status for b in batches]),
            cat(offs),
            cat([b.event_time for b in batches]),
            cat([b.event_tokens for b in batches]),
            cat([b.input_tokens for b in batches]),
        )
