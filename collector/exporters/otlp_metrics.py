"""OTLP metrics push (``--forward-metrics URL``): the registry's cumulative histograms and
counters, every ``interval_s``, through the OpenTelemetry SDK's OTLP metric exporters.

``URL``: ``http://host:4318`` (OTLP/HTTP protobuf, ``/v1/metrics`` appended) or
``grpc://host:4317``. Headers, TLS and timeouts follow the standard ``OTEL_EXPORTER_OTLP_*``
variables.
"""

from __future__ import annotations

import logging
import threading

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.metrics.export import (
    Histogram as HistogramData,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from ..pipeline.metrics_registry import Counter, Histogram

log = logging.getLogger("collector")
_SCOPE = InstrumentationScope("otel_llm.collector", "0.1.0")


def to_metrics_data(families: list, resource: Resource, start_ns: int, now_ns: int) -> MetricsData:
    metrics = []
    for f in families:
        if isinstance(f, Histogram):
            points = [
                HistogramDataPoint(
                    attributes=dict(zip(f.label_names, labels)),
                    start_time_unix_nano=start_ns,
                    time_unix_nano=now_ns,
                    count=s.count,
                    sum=s.sum,
                    bucket_counts=s.counts.tolist(),
                    explicit_bounds=list(f.bounds),
                    min=s.min,
                    max=s.max,
                )
                for labels, s in f.series.items()
            ]
            data = HistogramData(data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE)
        elif isinstance(f, Counter):
            points = [
                NumberDataPoint(
                    attributes=dict(zip(f.label_names, labels)),
                    start_time_unix_nano=start_ns,
                    time_unix_nano=now_ns,
                    value=int(v),
                )
                for labels, v in f.series.items()
            ]
            data = Sum(data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE, is_monotonic=True)
        else:
            continue
        if points:
            metrics.append(Metric(name=f.name, description=f.description, unit=f.unit, data=data))
    return MetricsData(
        resource_metrics=[
            ResourceMetrics(
                resource=resource,
                scope_metrics=[ScopeMetrics(scope=_SCOPE, metrics=metrics, schema_url="")],
                schema_url="",
            )
        ]
    )


def metric_exporter(url: str):
    if url.startswith("grpc://"):
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=url[len("grpc://") :], insecure=True)
    if url.startswith(("http://", "https://")):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HTTPMetricExporter

        endpoint = url.rstrip("/")
        if not endpoint.endswith("/v1/metrics"):
            endpoint += "/v1/metrics"
        return HTTPMetricExporter(endpoint=endpoint)
    raise ValueError(f"--forward-metrics {url!r}: expected http://HOST:PORT or grpc://HOST:PORT")


class MetricsPusher:
    def __init__(self, url: str, snapshot, start_ns: int, interval_s: float = 10.0, resource: Resource | None = None):
        self.exporter = metric_exporter(url)
        self.snapshot, self.start_ns, self.interval_s = snapshot, start_ns, interval_s
        self.resource = resource or Resource.create({"service.name": "otel-llm-collector"})
        self.pushed = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="otlp-metrics", daemon=True)

    def push(self) -> bool:
        import time

        from opentelemetry.sdk.metrics.export import MetricExportResult

        try:
            ok = (
                self.exporter.export(
                    to_metrics_data(self.snapshot(), self.resource, self.start_ns, time.time_ns()),
                    timeout_millis=10_000,
                )
                == MetricExportResult.SUCCESS
            )
        except Exception as exc:
            log.warning("collector: OTLP metrics push failed: %s", exc)
            ok = False
        if ok:
            self.pushed += 1
        else:
            self.failed += 1
        return ok

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.push()

    def start(self) -> MetricsPusher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.push()
        self.exporter.shutdown()
