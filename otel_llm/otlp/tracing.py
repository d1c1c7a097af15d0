"""The client side's tracer provider: standard OpenTelemetry SDK, exporter from the environment
(``OTEL_LLM_TRACES_FILE`` or ``OTEL_EXPORTER_OTLP_*``), batch processor, flushed at exit."""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Mapping

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from .. import environment
from .export import SafeSpanExporter, exporter_from_env

log = logging.getLogger("otel_llm")
_provider: TracerProvider | None = None
_lock = threading.Lock()


def make_resource(default_service: str, attrs: Mapping[str, object] | None = None) -> Resource:
    """A resource from ``attrs`` and the standard ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``
    (which win); the service name is ``attrs``' own, else ``default_service``, unless the
    environment names one."""
    extra = dict(attrs or {})
    service = extra.pop("service.name", default_service)
    env_attrs = environment.env_str(environment.RESOURCE_ATTRIBUTES, "")
    if not environment.raw(environment.SERVICE_NAME) and "service.name=" not in env_attrs:
        extra["service.name"] = service
    return Resource.create(extra)


def make_provider(resource_attrs: dict | None = None, exporter=None) -> TracerProvider:
    """A TracerProvider exporting to ``exporter`` (default: from the environment)."""
    tp = TracerProvider(resource=make_resource("otel-llm-client", resource_attrs))
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
