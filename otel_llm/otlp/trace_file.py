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
    :class:`TraceFileError` naming the file and the line; but a last line without its newline
    that does not parse is one a live writer has not finished (a file read while the engine
    still appends to it): it is left out, not an error. Lines are decoded as ``json.loads``
    decodes bytes (UTF-8, -16 or -32), so a line cut inside a character is such a line too."""
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                try:
                    req = from_dict(json.loads(line))
                except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
                    if not line.endswith(b"\n"):
                        return  # the end of the file, still being written
                    raise TraceFileError(path, lineno, f"not an OTLP JSON trace export: {exc}") from None
                yield lineno, req
