"""Span exporters and their configuration from the standard ``OTEL_*`` environment variables.

* :class:`FileSpanExporter`: OTLP JSON lines (one ``ExportTraceServiceRequest`` per line, hex ids),
  the format of the OpenTelemetry Collector's file exporter. Every process of a run can append to
  the same file: each batch is one ``write`` on an ``O_APPEND`` descriptor.
* :class:`SafeSpanExporter`: wraps any exporter so that it never raises, warns once, and counts
  the spans it could not deliver.
* :func:`exporter_from_env`: ``OTEL_LLM_TRACES_FILE`` (a path) wins; otherwise
  ``OTEL_TRACES_EXPORTER`` (``otlp`` by default, ``console``, ``none``) with
  ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf`` by
  default, or ``grpc``); the OTLP exporters read their own endpoint, header, timeout and
  compression variables (``OTEL_EXPORTER_OTLP_ENDPOINT`` and friends).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import urllib.parse
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from .. import environment
from . import otlp_encode, sdk_internals

log = logging.getLogger("otel_llm")


def takes_int_arrays(exporter: SpanExporter | None) -> bool:
    """Whether ``exporter`` encodes with :mod:`otel_llm.otlp.otlp_encode`, which takes int64 numpy
    arrays as attribute values (engine_hooks then skips making lists of its token-event arrays);
    any other exporter gets the types the OpenTelemetry API allows."""
    while isinstance(exporter, SafeSpanExporter):
        exporter = exporter.inner
    return bool(getattr(exporter, "takes_int_arrays", False))


class FileSpanExporter(SpanExporter):
    """Append spans to ``path`` as OTLP JSON lines."""

    takes_int_arrays = True  # otlp_encode.spans_to_json

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()

    def _open(self) -> int:
        if self._fd is None:
            d = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(d, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        return self._fd

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        line = (otlp_encode.spans_to_json(spans) + "\n").encode()
        with self._lock:
            fd = self._open()
            view = memoryview(line)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class SafeSpanExporter(SpanExporter):
    """Never raises; warns once per failure kind; counts what it could not deliver."""

    def __init__(self, inner: SpanExporter, name: str = "otel-llm"):
        self.inner = inner
        self.name = name
        self.exported = 0
        self.dropped = 0
        self._warned = False

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s: could not export spans (%s); dropping and counting them, tracing goes on", self.name, why)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._send(spans):
            self.exported += len(spans)
            return SpanExportResult.SUCCESS
        self.dropped += len(spans)
        return SpanExportResult.FAILURE

    def _send(self, spans: Sequence[ReadableSpan]) -> bool:
        """Hand ``spans`` to the inner exporter: whether it took them (not counted here)."""
        try:
            result = self.inner.export(spans)
        except Exception as exc:
            self._warn(f"{type(exc).__name__}: {exc}")
            return False
        if result is not SpanExportResult.SUCCESS:
            self._warn(f"exporter {type(self.inner).__name__} reported failure")
            return False
        return True

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        except Exception:
            pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis)
        except Exception:
            return False


def otlp_protocol() -> str:
    return (
        environment.raw(environment.OTLP_TRACES_PROTOCOL)
        or environment.raw(environment.OTLP_PROTOCOL)
        or "http/protobuf"
    ).strip()


def destination() -> str:
    """Where :func:`exporter_from_env` sends spans, in words (for a log line)."""
    path = environment.raw(environment.TRACES_FILE)
    if path:
        return f"the file {os.path.abspath(path)} (OTLP JSON lines)"
    kind = (environment.raw(environment.TRACES_EXPORTER) or "otlp").split(",")[0].strip().lower()
    if kind != "otlp":
        return {"none": "nowhere (OTEL_TRACES_EXPORTER=none)", "console": "the console"}.get(kind, kind)
    proto = otlp_protocol()
    url = environment.raw(environment.OTLP_TRACES_ENDPOINT)
    if url is None:
        base = environment.raw(environment.OTLP_ENDPOINT)
        if proto == "grpc":
            url = base or "http://localhost:4317"
        else:
            url = (base.rstrip("/") + "/v1/traces") if base else "http://localhost:4318/v1/traces"
    return f"OTLP/{'gRPC' if proto == 'grpc' else 'HTTP'} {url}"


def unreachable_endpoint(timeout_s: float = 0.5) -> str | None:
    """The OTLP endpoint the environment exports to, in words (:func:`destination`), when nothing
    accepts a TCP connection there; None when something does, or when export is not OTLP. One
    connect, for a command-line tool to say so at once rather than after the exporter's retries."""
    kind = export_kind_from_env()
    if kind not in ("grpc", "http"):
        return None
    where = destination()
    url = where.split(" ", 1)[1]
    parsed = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    host = parsed.hostname or "localhost"
    port = parsed.port or (443 if parsed.scheme == "https" else 4317 if kind == "grpc" else 4318)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return where
    return None


def export_kind_from_env() -> str | None:
    """Which exporter the environment asks for, without making it: ``file``, ``console``,
    ``grpc`` or ``http`` (OTLP), or None when tracing export is off; ValueError for a setting
    this does not support."""
    if environment.raw(environment.TRACES_FILE):
        return "file"
    kind = (environment.raw(environment.TRACES_EXPORTER) or "otlp").split(",")[0].strip().lower()
    if kind == "none":
        return None
    if kind == "console":
        return "console"
    if kind != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r} is not supported (otlp, console or none)")
    proto = otlp_protocol()
    if proto == "grpc":
        return "grpc"
    if proto in ("http/protobuf", "http"):
        return "http"
    raise ValueError(f"OTLP protocol {proto!r} is not supported (grpc or http/protobuf)")


def exporter_from_env() -> SpanExporter | None:
    """The exporter the environment asks for, or None when tracing export is off."""
    kind = export_kind_from_env()
    if kind == "file":
        return FileSpanExporter(environment.raw(environment.TRACES_FILE))
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind == "grpc":
        return grpc_exporter()
    if kind == "http":
        return http_exporter()
    return None


def grpc_exporter(**kwargs) -> SpanExporter:
    """The SDK's OTLP/gRPC span exporter (configured by the standard variables) with the fast
    encoder of :mod:`otel_llm.otlp.otlp_encode` for the token-event arrays."""
    exporter = sdk_internals.grpc_span_exporter(otlp_encode.encode_spans_bytes, **kwargs)
    exporter.takes_int_arrays = True
    return exporter


def http_exporter(**kwargs) -> SpanExporter:
    """The SDK's OTLP/HTTP (protobuf) span exporter (standard variables, retries, compression)
    with the fast encoder of :mod:`otel_llm.otlp.otlp_encode` for the token-event arrays."""
    exporter = sdk_internals.http_span_exporter(otlp_encode.encode_spans_bytes, **kwargs)
    exporter.takes_int_arrays = True
    return exporter
