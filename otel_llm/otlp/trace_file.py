"""Reading OTLP JSON-lines trace files (one ``ExportTraceServiceRequest`` per line, the format
``OTEL_LLM_TRACES_FILE`` and the OpenTelemetry Collector's file exporter write)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from .otlp_json import from_dict


class TraceFileError(ValueError):
    """A bad line in a traces file."""

    def __init__(self, path, line: int, problem: str):
        self.path, self.line, self.problem = str(path), line, problem
        super().__init__(f"{path}:{line}: {problem}")


def read_trace_requests(path: str | os.PathLike) -> Iterator[tuple[int, ExportTraceServiceRequest]]:
    """``(line number, request)`` for each line of an OTLP JSON-lines file (one
    ExportTraceServiceRequest per line; blank lines skipped). A bad line raises
    :class:`TraceFileError` naming the file and the line."""
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                try:
                    req = from_dict(json.loads(line))
                except (ValueError, json.JSONDecodeError) as exc:
                    raise TraceFileError(path, lineno, f"not an OTLP JSON trace export: {exc}") from None
                yield lineno, req
