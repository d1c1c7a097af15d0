"""Engine steps as the collector keeps them: one row per ``llm.engine.step`` span.

Step spans do not go through trace assembly (they are not part of any request's trace: the engine
exports them in traces of their own, under an ``llm.engine.steps`` span); the collector takes them
out of each export request as it is accepted and stores them in table ``steps`` beside
``requests``, where the report, the Perfetto export and the stall analysis read the engine's
timeline. Times are Unix ns on the engine's clock; ``service`` says which engine process.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import itemgetter

import numpy as np

from . import walked_span as sp

STEPS_SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (
  rowid INTEGER PRIMARY KEY,
  trace_id TEXT NOT NULL,
  span_id TEXT NOT NULL,
  service TEXT,
  start_ns INTEGER NOT NULL,
  end_ns INTEGER NOT NULL,
  step_index INTEGER,
  batch_size INTEGER,
  prefill_tokens INTEGER,
  decode_tokens INTEGER,
  preempted INTEGER,
  kv_usage REAL,
  gpu_time_ns INTEGER,
  waiting INTEGER,
  wait_reason TEXT,
  UNIQUE (trace_id, span_id)
);
CREATE INDEX IF NOT EXISTS steps_by_start ON steps (start_ns);
"""


@dataclass
class StepBatch:
    """Engine steps, column by column (``-1`` / NaN: not given)."""

    trace_id: list[str]
    span_id: list[str]
    service: list[str | None]
    start_ns: np.ndarray  # int64, Unix ns
    end_ns: np.ndarray  # int64, Unix ns
    step_index: np.ndarray  # int64
    batch_size: np.ndarray  # int64: requests in the step
    prefill_tokens: np.ndarray  # int64: prompt tokens computed in the step
    decode_tokens: np.ndarray  # int64: tokens generated in the step
    preempted: np.ndarray  # int64: requests preempted in the step
    kv_usage: np.ndarray  # float64, fraction 0..1 of the KV cache in use
    gpu_time_ns: np.ndarray  # int64: CUDA-event time of the step (-1: not measured)
    waiting: np.ndarray | None = None  # int64: requests left waiting after the step (-1: not said)
    wait_reason: list | None = None  # why they waited, as the engine says (None: not said, or none waiting)

    def __post_init__(self) -> None:
        n = len(self.start_ns)
        if self.waiting is None:
            self.waiting = np.full(n, -1, np.int64)
        if self.wait_reason is None:
            self.wait_reason = [None] * n

    def __len__(self) -> int:
        return len(self.start_ns)

    def take(self, idx) -> StepBatch:
        """The steps at ``idx`` (in that order)."""
        idx = np.asarray(idx, np.int64)
        pick = idx.tolist()
        return StepBatch(
            **{
                f.name: (
                    [getattr(self, f.name)[i] for i in pick]
                    if isinstance(getattr(self, f.name), list)
                    else getattr(self, f.name)[idx]
                )
                for f in fields(self)
            }
        )

    @property
    def duration_s(self) -> np.ndarray:
        return (self.end_ns - self.start_ns) / 1e9

    def rows(self) -> list[tuple]:
        cols = [getattr(self, f.name) for f in fields(self)]
        py = [c if isinstance(c, list) else c.tolist() for c in cols]
        kv = [None if v != v else v for v in py[10]]  # NaN -> NULL
        ints = lambda xs: [None if v == -1 else v for v in xs]
        return list(
            zip(py[0], py[1], py[2], py[3], py[4], *(ints(c) for c in py[5:10]), kv, ints(py[11]), ints(py[12]), py[13])
        )

    @classmethod
    def from_walked(cls, spans: list[tuple]) -> StepBatch:
        """Steps from walked ``llm.engine.step`` spans (attributes of other types: unknown)."""

        def num(i: int, kind=int, missing=-1):
            return [
                v if type(v) is kind or (kind is float and type(v) is int) else missing for v in (s[i] for s in spans)
            ]

        return cls(
            trace_id=[s[sp.TRACE_ID].hex() for s in spans],
            span_id=[s[sp.SPAN_ID].hex() for s in spans],
            service=[s[sp.SERVICE] if type(s[sp.SERVICE]) is str else None for s in spans],
            start_ns=np.array([s[sp.START] for s in spans], np.int64),
            end_ns=np.array([s[sp.END] for s in spans], np.int64),
            step_index=np.array(num(sp.STEP_INDEX), np.int64),
            batch_size=np.array(num(sp.STEP_BATCH_SIZE), np.int64),
            prefill_tokens=np.array(num(sp.STEP_PREFILL_TOKENS), np.int64),
            decode_tokens=np.array(num(sp.STEP_DECODE_TOKENS), np.int64),
            preempted=np.array(
                [int(v) if type(v) in (int, bool) else -1 for v in (s[sp.STEP_PREEMPTED] for s in spans)]
            ),
            kv_usage=np.array(num(sp.STEP_KV_USAGE, float, np.nan), np.float64),
            gpu_time_ns=np.array(num(sp.STEP_GPU_TIME_NS), np.int64),
            waiting=np.array(num(sp.STEP_WAITING), np.int64),
            wait_reason=[v[:64] if type(v) is str else None for v in (s[sp.STEP_WAIT_REASON] for s in spans)],
        )

    @classmethod
    def concat(cls, batches: list[StepBatch]) -> StepBatch:
        """Steps of several stores, by start time, each step once (by trace and span id)."""
        if len(batches) == 1:
            return batches[0]
        seen: dict = {}
        for b in batches:
            for r in b.rows():
                seen.setdefault((r[0], r[1]), r)
        return cls.from_rows(sorted(seen.values(), key=lambda r: (r[3], r[0], r[1])))

    @classmethod
    def from_rows(cls, rows: list[tuple]) -> StepBatch:
        cols = list(zip(*rows)) if rows else [()] * len(STEP_COLUMNS)
        ints = lambda xs: np.array([-1 if v is None else v for v in xs], np.int64)
        return cls(
            trace_id=list(cols[0]),
            span_id=list(cols[1]),
            service=list(cols[2]),
            start_ns=np.array(cols[3], np.int64),
            end_ns=np.array(cols[4], np.int64),
            step_index=ints(cols[5]),
            batch_size=ints(cols[6]),
            prefill_tokens=ints(cols[7]),
            decode_tokens=ints(cols[8]),
            preempted=ints(cols[9]),
            kv_usage=np.array([np.nan if v is None else v for v in cols[10]], np.float64),
            gpu_time_ns=ints(cols[11]),
            waiting=ints(cols[12]),
            wait_reason=[v if type(v) is str else None for v in cols[13]],
        )


STEP_COLUMNS = [f.name for f in fields(StepBatch)]


def split_steps(spans: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """Walked spans -> (those for trace assembly, the engine's step spans)."""
    code, step = sp.CODE, sp.STEP
    if step not in map(itemgetter(code), spans):  # iterated in C: most requests hold no step
        return spans, []
    return [s for s in spans if s[code] != step], [s for s in spans if s[code] == step]
