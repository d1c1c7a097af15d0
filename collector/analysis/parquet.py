"""``otel-llm export --format parquet``: the store's records as a Parquet table (and the engine's
steps as a second one), for DuckDB, pandas or Spark.

One row per request and boundary; one column per field of :data:`collector.pipeline.records.COLUMNS` with
its type (text, int64, float64 seconds, bool; null where unknown) and its unit and meaning in the
field's metadata, plus ``event_offsets_ns`` and ``event_tokens`` as lists of int64. Steps: one row
per ``llm.engine.step`` (:mod:`collector.pipeline.steps`).
"""

from __future__ import annotations

import os
from itertools import pairwise

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..pipeline.records import COLUMNS, FLAG, RecordBatch
from ..pipeline.steps import STEP_COLUMN_DECL, StepBatch


def _arrow_type(kind) -> pa.DataType:
    if kind is FLAG:
        return pa.bool_()
    if kind.dtype is None:
        return pa.string()
    return pa.float64() if kind.dtype == np.float64 else pa.int64()


def _field(c) -> pa.Field:
    """A declared column (records.Column) as a Parquet field: its type, unit and meaning."""
    return pa.field(c.name, _arrow_type(c.kind), metadata={"unit": c.unit, "doc": c.doc})


def records_table(batch: RecordBatch) -> pa.Table:
    cols = batch.scalar_columns()  # Python values, None where unknown
    fields, arrays = [], []
    for c in COLUMNS:
        fields.append(_field(c))
        arrays.append(pa.array(cols[c.name], type=fields[-1].type))
    st = batch.event_start.tolist()
    for name, values in (("event_offsets_ns", batch.event_offsets_ns), ("event_tokens", batch.event_tokens)):
        v = values.tolist()
        fields.append(pa.field(name, pa.list_(pa.int64())))
        arrays.append(pa.array([v[a:b] for a, b in pairwise(st)], type=pa.list_(pa.int64())))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def steps_table(steps: StepBatch) -> pa.Table:
    rows = steps.rows()
    cols = list(zip(*rows)) if rows else [()] * len(STEP_COLUMN_DECL)
    fields = [_field(c) for c in STEP_COLUMN_DECL]
    arrays = [pa.array(list(v), type=f.type) for v, f in zip(cols, fields)]
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def write_parquet(batch: RecordBatch, steps: StepBatch | None, path: str) -> tuple[int, str, int]:
    """Write the records to ``path`` and the steps beside it (``*.steps.parquet``)."""
    pq.write_table(records_table(batch), path)
    root, _ = os.path.splitext(path)
    steps_path = root + ".steps.parquet"
    st = steps if steps is not None else StepBatch.from_rows([])
    pq.write_table(steps_table(st), steps_path)
    return len(batch), steps_path, len(st)
