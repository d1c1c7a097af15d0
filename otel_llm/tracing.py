"""The client side's tracer provider: standard OpenTelemetry SDK, exporter from the environment
(``OTEL_LLM_TRACES_FILE`` or ``OTEL_EXPORTER_OTLP_*``), batch processor, flushed at exit."""

from __future__ import annotations

import atexit
import logging
import threading

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from .export import SafeSpanExporter, exporter_from_env

log = logging.getLogger("otel_llm")
_provider: TracerProvider | None = None
_lock = threading.Lock()


def make_provider(resource_attrs: dict | None = None, exporter=None) -> TracerProvider:
    """A TracerProvider exporting to ``exporter`` (default: from the environment)."""
    attrs = {"service.name": "otel-llm-client", **(resource_attrs or {})}
    import os

    if os.environ.get("OTEL_SERVICE_NAME"):
        attrs.pop("service.name", None)
    tp = TracerProvider(resource=Resource.create(attrs))
    if exporter is None:
        try:
            exporter = exporter_from_env()
        except ValueError as exc:
            log.warning("otel-llm: %s; client spans are not exported", exc)
    if exporter is not None:
        tp.add_span_processor(BatchSpanProcessor(SafeSpanExporter(exporter, "otel-llm client")))
    atexit.register(tp.shutdown)
    return tp


def default_provider() -> TracerProvider:
    global _provider
    with _lock:
        if _provider is None:
            _provider = make_provider()
        return _provider
