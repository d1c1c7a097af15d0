"""Derivation from a traces file (OTLP JSON lines, as ``OTEL_LLM_TRACES_FILE`` writes them),
without running the collector: the same decoding, assembly and derivation, all at once.

Entry point ``otel_llm.timeline_sources: traces`` (``otel-llm analyze --traces FILE``).
"""

from __future__ import annotations

import os

from otel_llm.metrics.selection import Selection
from otel_llm.metrics.timeline import TimelineBatch
from otel_llm.otlp.trace_file import read_trace_requests

from ..pipeline.account_kinds import every_kind
from ..pipeline.assembly import AssemblyConfig, TraceAssembler
from ..pipeline.derive import derive
from ..pipeline.records import RecordBatch
from ..pipeline.steps import StepBatch, split_steps
from ..receivers.decode import walk_message


def read_trace_file(path: str) -> tuple[RecordBatch, StepBatch]:
    """Every record derived from a traces file, and the engine steps in it. Raises
    FileNotFoundError, or :class:`~otel_llm.otlp.trace_file.TraceFileError` (a ValueError naming the
    line) for a bad line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such traces file")
    asm = TraceAssembler(AssemblyConfig(max_traces=10**9, max_spans_per_trace=2**62))
    accounts = every_kind(limit=10**9)
    steps: list[tuple] = []
    for _, req in read_trace_requests(path):
        spans, st = split_steps(walk_message(req).spans)
        spans, said = accounts.split(spans)
        asm.add(spans, 0.0)
        accounts.add(said)
        steps += st
    batch, _ = derive(asm.flush())
    accounts.join(batch)
    steps.sort(key=lambda s: s[5])
    return batch, StepBatch.from_walked(steps)


def batch_from_trace_file(path: str) -> RecordBatch:
    """Every record derived from a traces file (see :func:`read_trace_file`)."""
    return read_trace_file(path)[0]


def load_timelines(path: str, boundary: str, selection: Selection | None = None) -> TimelineBatch:
    """The records of one boundary that ``selection`` keeps, as timelines in Unix seconds."""
    return batch_from_trace_file(path).at_boundary(boundary).selected(selection).timelines(epoch_ns=0)
