"""What tracing costs this process, as OpenTelemetry metrics beside its spans.

One ``MeterProvider`` per traced process, started with its first pipeline, exporting every
``OTEL_METRIC_EXPORT_INTERVAL`` ms (the SDK's variable and default, 60 s) to where the standard
variables say (``OTEL_METRICS_EXPORTER``, default ``otlp``; ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``
or ``OTEL_EXPORTER_OTLP_ENDPOINT``; the protocol of ``OTEL_EXPORTER_OTLP_PROTOCOL``). Cumulative
counters, read from the pipelines' own counters when the SDK collects, one series per pipeline
(``otel_llm.pipeline``: its engine and boundary):

each of ``otel_llm.semconv.TRACER_METRICS`` (``otel_llm.tracer.*``: CPU time of span building
and export, spans exported and dropped, hook events dropped, requests not sampled, requests and
steps seen, so the CPU per request and per step can be read off).

Nothing is sent when traces are not (``OTEL_TRACES_EXPORTER=none``, or spans to
``OTEL_LLM_TRACES_FILE``), nor when no OTLP endpoint is configured (the SDK's default
``localhost``), unless ``OTEL_METRICS_EXPORTER`` asks; never with ``OTEL_METRICS_EXPORTER=none``.
The otel-llm collector keeps these series (:mod:`collector.receivers.tracer_cost`) and serves them
on its ``/metrics``.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from otel_llm import environment
from otel_llm import semconv as sc

log = logging.getLogger("engine_hooks")

_provider = None
_lock = threading.Lock()

#: each tracer metric (otel_llm.semconv.TRACER_METRICS) and how it is read off a pipeline's counters
METRICS = (
    (sc.TRACER_CPU_TIME, lambda c: (c.cpu_ns + c.span_process_cpu_ns) / 1e9),
    (sc.TRACER_SPANS_EXPORTED, lambda c: c.spans_exported),
    (sc.TRACER_SPANS_DROPPED, lambda c: c.spans_dropped),
    (sc.TRACER_EVENTS_DROPPED, lambda c: c.events_dropped),
    (sc.TRACER_REQUESTS_UNSAMPLED, lambda c: c.requests_unsampled),
    (sc.TRACER_REQUESTS, lambda c: c.requests_traced),
    (sc.TRACER_STEPS, lambda c: c.steps_traced),
)


def wanted() -> bool:
    """Whether this process should send its tracing cost (see the module's docstring)."""
    asked = environment.raw(environment.METRICS_EXPORTER)
    if asked is not None:
        return asked.strip().lower() not in ("none", "")
    if environment.raw(environment.TRACES_FILE) is not None:
        return False
    if (environment.raw(environment.TRACES_EXPORTER) or "otlp").strip().lower() != "otlp":
        return False
    # an endpoint someone configured: not the SDK's default localhost, where nothing may listen
    return any(environment.raw(v) is not None for v in (environment.OTLP_ENDPOINT, environment.OTLP_METRICS_ENDPOINT))


def _exporter():
    protocol = (
        environment.raw(environment.OTLP_METRICS_PROTOCOL)
        or environment.raw(environment.OTLP_PROTOCOL)
        or "http/protobuf"
    )
    if protocol.strip().lower() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    return OTLPMetricExporter()


def start(pipelines, resource) -> object | None:
    """The process's meter provider over ``pipelines`` (an iterable read at every collection),
    started once; None when not :func:`wanted` or the SDK cannot be set up."""
    global _provider
    with _lock:
        if _provider is not None and _provider[0] == os.getpid():
            return _provider[1]
        if not wanted():
            return None
        try:
            from opentelemetry.metrics import CallbackOptions, Observation
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            from opentelemetry.sdk.resources import Resource

            pid = os.getpid()
            reader = PeriodicExportingMetricReader(_exporter())  # OTEL_METRIC_EXPORT_INTERVAL, as the SDK reads it
            mp = MeterProvider(  # shut down by this module's shutdown(), after the pipelines' final flush
                metric_readers=[reader], resource=resource.merge(Resource({"process.pid": pid})), shutdown_on_exit=False
            )
            meter = mp.get_meter("engine_hooks", "0.1.0")

            def callback(read):
                def observe(options: CallbackOptions):
                    if os.getpid() != pid:  # inherited by a forked child: that child reports as itself
                        return []
                    out = []
                    for p in list(pipelines):
                        label = f"{p.factory.engine or 'engine'}/{p.factory.boundary}"
                        out.append(Observation(read(p.counters), {"otel_llm.pipeline": label}))
                    return out

                return observe

            for m, read in METRICS:
                meter.create_observable_counter(m.name, callbacks=[callback(read)], unit=m.unit, description=m.help)
        except Exception as exc:  # tracing goes on without its cost metrics
            log.warning("engine_hooks: the tracer's own metrics are off (%s: %s)", type(exc).__name__, exc)
            return None
        _provider = (os.getpid(), mp)
        return mp


def shutdown(deadline: float | None = None) -> None:
    """Send the last values (at exit, after the pipelines' final flush), for at most 3 s and not
    past ``deadline`` (``time.monotonic()``)."""
    global _provider
    with _lock:
        if _provider is not None and _provider[0] == os.getpid():
            left_ms = 3000 if deadline is None else min(3000, int((deadline - time.monotonic()) * 1000))
            try:
                _provider[1].shutdown(timeout_millis=max(1, left_ms))
            except Exception:
                pass
        _provider = None
