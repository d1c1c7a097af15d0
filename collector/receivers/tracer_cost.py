"""OTLP metrics from the traced processes about tracing itself (``otel_llm.tracer.*``, sent by
:mod:`engine_hooks.spans.self_metrics`): what tracing costs each process, kept as the collector's own
counters so that ``/metrics`` (and Grafana) show it beside what it measures.

``POST /v1/metrics`` and gRPC ``MetricsService/Export`` take any OTLP metrics; only cumulative
sums named ``otel_llm.tracer.*`` are kept (their latest value per series), everything else is
acknowledged and counted as ignored (this collector is not a metrics backend). Series are keyed by
the sender's ``service.name``, ``service.instance.id`` (else ``process.pid``) and the point's
``otel_llm.pipeline`` attribute, at most ``max_series`` of them over at most ``max_names``
metric names; a name outside ``otel_llm.tracer.`` + ``[a-z0-9_.]`` (at most 100 characters) is
ignored, so no sender can put its text into the ``/metrics`` exposition.
"""

from __future__ import annotations

import re
import threading

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from otel_llm import semconv as sc

from .decode import DecodeError, PayloadTooLarge, gunzip

PREFIX = sc.TRACER_PREFIX
_NAME = re.compile(re.escape(PREFIX) + r"[a-z0-9_.]{1,100}")
LABELS = ("service", "instance", "pipeline")


def _attr(kvs, key: str) -> str:
    for kv in kvs:
        if kv.key == key:
            v = kv.value
            return str(getattr(v, v.WhichOneof("value"))) if v.WhichOneof("value") else ""
    return ""


class TracerCosts:
    """The latest cumulative value of each ``otel_llm.tracer.*`` series received."""

    def __init__(self, max_series: int = 10_000, max_names: int = 64):
        self.max_series, self.max_names = max_series, max_names
        self.values: dict[str, dict[tuple, float]] = {}  # metric name -> labels -> value
        self.units: dict[str, str] = {}
        self.points_kept = self.points_ignored = self.series_refused = 0
        self._lock = threading.Lock()

    def accept(self, body: bytes, *, json_body: bool = False, gzipped: bool = False, max_bytes: int) -> bytes:
        """Take one export request; returns the serialized response (protobuf, or JSON when
        ``json_body``). Raises DecodeError / PayloadTooLarge."""
        if len(body) > max_bytes:
            raise PayloadTooLarge(f"body of {len(body)} bytes is over the {max_bytes}-byte limit")
        if gzipped:
            body = gunzip(body, max_bytes)
        req = ExportMetricsServiceRequest()
        try:
            if json_body:
                from google.protobuf import json_format

                json_format.Parse(body.decode("utf-8"), req, ignore_unknown_fields=True)
            else:
                req.ParseFromString(body)
        except Exception as exc:  # protobuf raises DecodeError, JSON ParseError or UnicodeDecodeError
            raise DecodeError(f"not an OTLP ExportMetricsServiceRequest: {exc}") from None
        with self._lock:
            for rm in req.resource_metrics:
                service = _attr(rm.resource.attributes, "service.name")
                instance = _attr(rm.resource.attributes, "service.instance.id") or _attr(
                    rm.resource.attributes, "process.pid"
                )
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        self._metric(m, service, instance)
        resp = ExportMetricsServiceResponse()
        if json_body:
            from google.protobuf import json_format

            return json_format.MessageToJson(resp).encode()
        return resp.SerializeToString()

    def _metric(self, m, service: str, instance: str) -> None:
        if not _NAME.fullmatch(m.name) or m.WhichOneof("data") != "sum":
            self.points_ignored += self._points(m)
            return
        series = self.values.get(m.name)
        for p in m.sum.data_points:
            key = (service, instance, _attr(p.attributes, "otel_llm.pipeline"))
            if series is None or key not in series:
                full = sum(map(len, self.values.values())) >= self.max_series
                if full or (series is None and len(self.values) >= self.max_names):
                    self.series_refused += 1
                    continue
                if series is None:  # a family exists only once it has a series
                    series = self.values[m.name] = {}
                    self.units[m.name] = m.unit
            series[key] = p.as_double if p.WhichOneof("value") == "as_double" else float(p.as_int)
            self.points_kept += 1

    @staticmethod
    def _points(m) -> int:
        kind = m.WhichOneof("data")
        return len(getattr(m, kind).data_points) if kind else 0

    def snapshot(self) -> dict[str, tuple[str, dict[tuple, float]]]:
        with self._lock:
            return {name: (self.units.get(name, ""), dict(s)) for name, s in self.values.items()}


#: each declared tracer metric's help (otel_llm.semconv.TRACER_METRICS)
DESCRIPTIONS = {m.name: m.help for m in sc.TRACER_METRICS}


def families(costs: TracerCosts) -> list:
    """The received series as the registry's counter families (rendered and pushed with the rest)."""
    from ..pipeline.metrics_registry import Counter

    out = []
    for name, (unit, series) in sorted(costs.snapshot().items()):
        desc = DESCRIPTIONS.get(name, "reported by a traced process about its own tracing")
        out.append(Counter(name, unit, f"{desc} (as the process reported it)", LABELS, series))
    return out
