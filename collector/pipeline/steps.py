"""Engine steps as the collector keeps them: one row per ``llm.engine.step`` span.

Step spans do not go through trace assembly (they are not part of any request's trace: the engine
exports them in traces of their own, under an ``llm.engine.steps`` span); the collector takes them
out of each export request as it is accepted and stores them in table ``steps`` beside
``requests``, where the report, the Perfetto export and the stall analysis read the engine's
timeline. Times are Unix ns on the engine's clock; ``service`` says which engine process.
"""

from __future__ import annotations

from dataclasses import field, fields, make_dataclass

import numpy as np

from . import walked_span as sp
from .records import FRACTION, INT, NS, TEXT, Column, from_python, to_python

#: The steps table, one column per entry: how each is held in a :class:`StepBatch` and in SQLite,
#: and what it means. The table, the batch, its rows and the Parquet export are made from it.
STEP_COLUMN_DECL: tuple[Column, ...] = (
    Column("trace_id", TEXT, "", "the trace of the step spans' export batch (llm.engine.steps), 32 hex digits"),
    Column("span_id", TEXT, "", "the llm.engine.step span, 16 hex digits"),
    Column("service", TEXT, "", "service.name of the engine process (None: not given)"),
    Column("start_ns", NS, "ns", "the step began, Unix ns on the engine's clock"),
    Column("end_ns", NS, "ns", "the step ended, Unix ns"),
    Column("step_index", INT, "", "the engine's iteration number", unknown=-1),
    Column("batch_size", INT, "", "requests in the step", unknown=-1),
    Column("prefill_tokens", INT, "tokens", "prompt tokens computed in the step", unknown=-1),
    Column(
        "decode_tokens",
        INT,
        "tokens",
        "tokens of the requests decoding in the step (speculative decoding: each one's last token and its drafts)",
        unknown=-1,
    ),
    Column("preempted", INT, "", "requests preempted in the step", unknown=-1),
    Column("kv_usage", FRACTION, "", "the KV cache's used fraction, 0..1"),
    Column("gpu_time_ns", INT, "ns", "CUDA-event time of the step (unknown: not measured)", unknown=-1),
    Column("waiting", INT, "", "requests left waiting after the step", unknown=-1),
    Column("wait_reason", TEXT, "", "why they waited, as the engine says (None: not said, or none waiting)"),
    Column(
        "draft_tokens",
        INT,
        "tokens",
        "speculative decoding: draft tokens the step verified (unknown: no speculation, or not said)",
        unknown=-1,
    ),
    Column("accepted_tokens", INT, "tokens", "of the step's draft tokens, those accepted", unknown=-1),
)
STEP_COLUMNS = [c.name for c in STEP_COLUMN_DECL]
_REQUIRED = ("trace_id", "span_id", "start_ns", "end_ns")  # every step has them

STEPS_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS steps (\n  rowid INTEGER PRIMARY KEY,\n"
    + "".join(f"  {c.name} {c.kind.sqlite}{' NOT NULL' if c.name in _REQUIRED else ''},\n" for c in STEP_COLUMN_DECL)
    + "  UNIQUE (trace_id, span_id)\n);\nCREATE INDEX IF NOT EXISTS steps_by_start ON steps (start_ns);\n"
)


class _StepMethods:
    """Engine steps, column by column: one field per :data:`STEP_COLUMN_DECL` entry (numpy arrays,
    lists for text; unknown as each column says: -1, NaN, None). A column not given is unknown in
    every step."""

    def __post_init__(self) -> None:
        n = len(self.start_ns)
        for c in STEP_COLUMN_DECL:
            if getattr(self, c.name) is None:
                setattr(self, c.name, from_python(c, [None] * n))

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
        """The steps as SQLite rows, in :data:`STEP_COLUMNS` order (None where unknown)."""
        return list(zip(*(to_python(c, getattr(self, c.name)) for c in STEP_COLUMN_DECL)))

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
            draft_tokens=np.array(num(sp.STEP_DRAFT_TOKENS), np.int64),
            accepted_tokens=np.array(num(sp.STEP_ACCEPTED_TOKENS), np.int64),
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
        """The inverse of :meth:`rows`."""
        cols = list(zip(*rows)) if rows else [()] * len(STEP_COLUMN_DECL)
        return cls(**{c.name: from_python(c, v) for c, v in zip(STEP_COLUMN_DECL, cols)})


StepBatch = make_dataclass(
    "StepBatch",
    [(c.name, list if c.kind.dtype is None else np.ndarray, field(default=None)) for c in STEP_COLUMN_DECL],
    bases=(_StepMethods,),
    namespace={"__module__": __name__},
    eq=False,
)
StepBatch.__doc__ = _StepMethods.__doc__


def split_steps(spans: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """Walked spans -> (those for trace assembly, the engine's step spans)."""
    return sp.split_code(spans, sp.STEP)
