"""Derivation from a traces file (OTLP JSON lines, as ``OTEL_LLM_TRACES_FILE`` writes them),
without running the collector: the same decoding, assembly and derivation, all at once.

Entry point ``otel_llm.timeline_sources: traces`` (``otel-llm analyze --traces FILE``).
"""

from __future__ import annotations

import os

from otel_llm.otlp_spans import TraceFileError, read_trace_requests

from .assembly import AssemblyConfig, TraceAssembler
from .derive import derive
from .receivers.decode import walk_message
from .records import RequestRecord, records_to_batch


def records_from_trace_file(path: str) -> list[RequestRecord]:
    from otel_llm.timeline_file import TimelineFormatError

    if not os.path.exists(path):
        raise TimelineFormatError(path, None, "no such traces file")
    asm = TraceAssembler(AssemblyConfig(max_traces=10**9))
    try:
        for _, req in read_trace_requests(path):
            asm.add(walk_message(req).spans, 0.0)
    except TraceFileError as exc:
        raise TimelineFormatError(exc.path, exc.line, exc.problem) from None
    batch, _ = derive(asm.flush())
    return batch.records()


def load_timelines(path: str, boundary: str):
    return records_to_batch([r for r in records_from_trace_file(path) if r.boundary == boundary])
