"""What tracing costs a traced process, as OpenTelemetry metrics beside its spans
(engine_hooks/spans/self_metrics.py), and the collector keeping them on its /metrics
(collector/receivers/tracer_cost.py): a real traced process end to end, then the receiver's
rules (what it keeps, what it ignores, what it refuses) over both transports."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys

import grpc
import pytest
from conftest import ROOT
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from support.otlp_helpers import metrics_body, metrics_text, post_metrics, wait_for


def value(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_traced_process_reports_its_tracing_cost_to_the_collector(make_collector):
    c = make_collector()
    env = {
        **os.environ,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{c.receivers[1].address[1]}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_METRIC_EXPORT_INTERVAL": "200",
        "OTEL_SERVICE_NAME": "toy",
        "OTEL_LLM_DETAIL": "steps",
    }
    env.pop("OTEL_LLM_TRACES_FILE", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "toy_engine.py")], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    wait_for(lambda: value(metrics_text(c), "otel_llm_tracer_spans_exported_total", service="toy"), what="metrics")
    text = metrics_text(c)
    exported = value(text, "otel_llm_tracer_spans_exported_total", service="toy", pipeline="toy-engine/engine")
    assert exported == c.receiver_counters.spans > 0  # what it says it sent is what arrived
    assert value(text, "otel_llm_tracer_spans_dropped_total", service="toy") == 0
    assert value(text, "otel_llm_tracer_requests_total", service="toy") == 12  # the toy engine's main: 12
    assert value(text, "otel_llm_tracer_steps_total", service="toy") > 0
    assert 0 < value(text, "otel_llm_tracer_cpu_time_total", service="toy") < 60
    # one series per process: its service.instance.id (the SDK's resource gives each process one), else its pid
    assert re.search(r'otel_llm_tracer_cpu_time_total\{service="toy",instance="[^"]+",pipeline=', text)


def test_the_receiver_keeps_the_tracer_series_and_only_those(make_collector):
    c = make_collector()
    body = metrics_body(
        [("otel_llm.tracer.cpu_time", "sum", 1.5), ("some.app.metric", "sum", 9.0), ("x", "gauge", 1.0)]
    )
    code, resp = post_metrics(c, body)
    assert code == 200 and ExportMetricsServiceResponse.FromString(resp) == ExportMetricsServiceResponse()
    text = metrics_text(c)
    assert value(text, "otel_llm_tracer_cpu_time_total", service="svc", instance="7", pipeline="vllm/engine") == 1.5
    assert "some_app_metric" not in text and c.tracer_costs.points_ignored == 2
    post_metrics(c, metrics_body([("otel_llm.tracer.cpu_time", "sum", 2.5)]))  # cumulative: the latest value
    assert value(metrics_text(c), "otel_llm_tracer_cpu_time_total", service="svc", instance="7") == 2.5
    assert (
        post_metrics(
            c, gzip.compress(metrics_body([("otel_llm.tracer.cpu_time", "sum", 3.0)])), **{"Content-Encoding": "gzip"}
        )[0]
        == 200
    )
    assert value(metrics_text(c), "otel_llm_tracer_cpu_time_total", service="svc", instance="7") == 3.0
    # gRPC's MetricsService/Export, another process
    channel = grpc.insecure_channel(f"127.0.0.1:{c.receivers[0].port}")
    call = channel.unary_unary("/opentelemetry.proto.collector.metrics.v1.MetricsService/Export")
    assert call(metrics_body([("otel_llm.tracer.spans.exported", "sum", 42.0)], pid=8), timeout=10) == b""
    assert value(metrics_text(c), "otel_llm_tracer_spans_exported_total", instance="8") == 42.0
    with pytest.raises(grpc.RpcError) as err:
        call(b"\xff\xff\xff", timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_receiver_refuses_what_it_cannot_take(make_collector):
    c = make_collector()
    assert post_metrics(c, b"\x0a\xff\xff")[0] == 400  # not a message
    assert post_metrics(c, b"{not json", "application/json")[0] == 400
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", c.receivers[1].address[1], timeout=10)
    conn.putrequest("POST", "/v1/metrics")
    conn.putheader("Content-Type", "application/x-protobuf")
    conn.putheader("Content-Length", str(c.config.max_message_bytes + 1))
    conn.endheaders()  # answered from the headers, before any body is read
    assert conn.getresponse().status == 413
    c.tracer_costs.max_series = 2
    for pid in range(4):
        post_metrics(c, metrics_body([("otel_llm.tracer.cpu_time", "sum", 1.0)], pid=pid))
    assert c.tracer_costs.series_refused == 2  # bounded: a sender cannot grow the scrape without end
    assert sum(1 for line in metrics_text(c).splitlines() if line.startswith("otel_llm_tracer_cpu_time_total{")) == 2


@pytest.mark.skipif(not __import__("shutil").which("promtool"), reason="Debian's prometheus (make prometheus)")
def test_no_sender_can_break_the_exposition(make_collector, tmp_path):
    """Names with a newline, a space, '/', quotes; 2,000 distinct names; label values with quotes
    and newlines: /metrics stays one parseable exposition (promtool check metrics), with a bounded
    number of families."""
    c = make_collector()
    hostile = [
        "otel_llm.tracer.x 1\n# TYPE evil gauge\nevil",
        "otel_llm.tracer.a/b",
        'otel_llm.tracer."q"',
        "otel_llm.tracer.",
        "otel_llm.tracer." + "z" * 300,
    ]
    assert post_metrics(c, metrics_body([(n, "sum", 1.0) for n in hostile], service='s"\n\\'))[0] == 200
    assert post_metrics(c, metrics_body([(f"otel_llm.tracer.n{i}", "sum", float(i)) for i in range(2000)]))[0] == 200
    text = metrics_text(c)
    assert "evil" not in text and "a/b" not in text
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE otel_llm_tracer_")}
    assert len(families) == c.tracer_costs.max_names
    path = tmp_path / "metrics.txt"
    path.write_text(text)
    check = subprocess.run(["promtool", "check", "metrics"], stdin=path.open(), capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr  # lint-clean too: every family has HELP


def test_the_tracers_own_metrics_are_declared_once_and_read_from_there():
    """otel_llm.semconv.TRACER_METRICS is what a traced process sends (each read off its pipeline's
    counters), what the collector describes on /metrics, and what the docs name: a metric added on
    one side only fails here."""
    from pathlib import Path

    from collector.receivers import tracer_cost
    from engine_hooks.spans import self_metrics
    from otel_llm import semconv as sc

    assert [m for m, _ in self_metrics.METRICS] == list(sc.TRACER_METRICS)
    assert set(tracer_cost.DESCRIPTIONS) == {m.name for m in sc.TRACER_METRICS}
    assert all(m.name.startswith(tracer_cost.PREFIX) and tracer_cost._NAME.fullmatch(m.name) for m in sc.TRACER_METRICS)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert [m.name for m in sc.TRACER_METRICS if m.name.removeprefix("otel_llm.tracer") not in doc] == []
