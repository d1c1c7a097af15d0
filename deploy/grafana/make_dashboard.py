"""Writes deploy/grafana/dashboards/otel-llm.json, the Grafana dashboard of the collector's metrics.

Target: Grafana 11 (dashboard JSON model, schemaVersion 39). Every panel is PromQL over the
collector's /metrics; ``tests/integration/test_grafana.py`` evaluates each expression against a real Prometheus
that scraped a collector under a known load, and checks the JSON against the model's schema.

Run: ``.venv/bin/python deploy/grafana/make_dashboard.py`` (the test fails if the JSON differs).
"""

from __future__ import annotations

import json
import os

from collector.exporters.prometheus import family_name
from collector.health import exposed_name
from collector.pipeline.metrics_registry import FAMILIES
from collector.pipeline.stalls import STALL_CLASSES
from collector.pipeline.ttft_parts import PARTS
from otel_llm import semconv as sc

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "dashboards", "otel-llm.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
M = 'model=~"$model"'
R = "$__rate_interval"

#: The exposed name of each derived family (metrics_registry.FAMILIES), by its registry attribute.
N = {f.attr: family_name(f.name, f.unit, f.buckets is not None) for f in FAMILIES}

_panels: list[dict] = []
_y = 0


def _tracer(m: sc.TracerMetric) -> str:
    """A tracer metric's name on the collector's /metrics (a counter: ``_total``)."""
    return family_name(m.name, m.unit, False)


def _quantiles(metric: str) -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by (le, boundary) (rate({metric}_bucket{{{M}}}[{R}])))",
            f"p{int(q * 100)} {{{{boundary}}}}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


def panel(
    title: str,
    targets: list[tuple[str, str]],
    unit: str,
    *,
    w: int = 12,
    h: int = 8,
    stack: bool = False,
    kind: str = "timeseries",
    description: str = "",
) -> None:
    global _y
    x = (
        0
        if not _panels or _panels[-1]["gridPos"]["x"] + _panels[-1]["gridPos"]["w"] + w > 24
        else (_panels[-1]["gridPos"]["x"] + _panels[-1]["gridPos"]["w"])
    )
    if x == 0 and _panels:
        _y += _panels[-1]["gridPos"]["h"]
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 30 if stack else 0, "showPoints": "never"}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    _panels.append(
        {
            "id": len(_panels) + 1,
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": {"h": h, "w": w, "x": x, "y": _y},
            "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [
                {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend, "datasource": DS}
                for i, (expr, legend) in enumerate(targets)
            ],
        }
    )


def _by_connector(metric: str, qs=(0.5, 0.9)) -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by (le, connector) (rate({metric}_bucket{{{M}}}[{R}])))",
            f"p{int(q * 100)} {{{{connector}}}}",
        )
        for q in qs
    ]


def _pd_row() -> None:
    """Disaggregated prefill/decode (docs/metrics/disaggregated.md): the KV transfer, its share of
    the client's TTFT, what it moved and how long the prefill engine held the blocks."""
    panel(
        "P/D: KV transfer (decode engine) and KV hold (prefill engine)",
        [(q, f"transfer {leg}") for q, leg in _by_connector(N["kv_transfer"])]
        + [(q, f"hold {leg}") for q, leg in _by_connector(N["kv_hold"])],
        "s",
        description="kv_transfer: the decode engine's load started -> its scheduler saw the transfer complete; "
        "hold: the prefill engine's finish -> the blocks freed once the decode side had read them",
    )
    panel(
        "P/D: KV transfer's share of the client TTFT",
        _by_connector(N["kv_share"]),
        "percentunit",
        description="each disaggregated request's kv_transfer / its client TTFT",
    )
    panel(
        "P/D: KV moved",
        [
            (f"sum by (connector) (rate({N['kv_bytes']}{{{M}}}[{R}]))", "bytes/s {{connector}}"),
            (f"sum by (connector) (rate({N['kv_blocks']}{{{M}}}[{R}]))", "blocks/s {{connector}}"),
        ],
        "Bps",
        description="the bytes NIXL's telemetry says it moved, and the KV blocks the decode engines' loads asked for",
    )


def build() -> dict:
    _panels.clear()
    global _y
    _y = 0
    panel(
        "Time to first token",
        _quantiles(N["ttft"]),
        "s",
        description="TTFT quantiles at each boundary (client: what the caller saw; engine: arrival to first output)",
    )
    panel("Time per output token", _quantiles(N["tpot"]), "s")
    panel(
        "Inter-token latency",
        _quantiles(N["itl"]),
        "s",
        description="every gap between token events of completed requests, pooled",
    )
    panel("End-to-end latency", _quantiles(N["duration"]), "s")
    panel(
        "Client TTFT in its parts (mean per request)",
        [
            (
                f"sum by (part) (rate({N['ttft_part']}_sum{{{M}}}[{R}])) / sum by (part) "
                f"(rate({N['ttft_part']}_count{{{M}}}[{R}]))",
                "{{part}}",
            )
        ],
        "s",
        stack=True,
        description="; ".join(f"{p.name}: {p.begins} -> {p.ends}" for p in PARTS)
        + ". The parts that span two clocks are uncorrected here (otel-llm compare corrects them)",
    )
    panel(
        "Stall seconds by cause (per second)",
        [(f"sum by (cause) (rate({N['stall_seconds']}{{{M}}}[{R}]))", "{{cause}}")],
        "s",
        stack=True,
        description="each paired request's largest client gap over the stall threshold, by the layer where it "
        f"first shows: {', '.join(STALL_CLASSES)} (delivery: api_server or network/client, without the server "
        "span to tell them apart)",
    )
    panel(
        "Goodput per SLO",
        [(f"sum by (slo, boundary) (rate({N['good']}{{{M}}}[{R}]))", "{{slo}} {{boundary}}")],
        "reqps",
    )
    panel(
        "SLO attainment",
        [
            (
                f"sum by (slo, boundary) (rate({N['good']}{{{M}}}[{R}])) / ignoring(slo) group_left "
                f'sum by (boundary) (rate({N["requests"]}{{{M},status="ok"}}[{R}]))',
                "{{slo}} {{boundary}}",
            )
        ],
        "percentunit",
    )
    panel(
        "Requests by status",
        [(f"sum by (status, boundary) (rate({N['requests']}{{{M}}}[{R}]))", "{{status}} {{boundary}}")],
        "reqps",
        stack=True,
    )
    panel(
        "Output tokens per second",
        [(f"sum by (boundary) (rate({N['output_tokens']}{{{M}}}[{R}]))", "{{boundary}}")],
        "short",
    )
    _pd_row()
    panel(
        "Collector: spans in, rejected, evicted, late",
        [
            (f"sum(rate({exposed_name('receiver_spans')}[{R}]))", "spans in"),
            (f"sum(rate({exposed_name('receiver_spans_rejected')}[{R}]))", "rejected"),
            (f"sum(rate({exposed_name('assembly_traces_evicted')}[{R}]))", "traces evicted"),
            (f"sum(rate({exposed_name('assembly_spans_late')}[{R}]))", "late spans dropped"),
            (f"sum(rate({exposed_name('receiver_payloads_refused_overload')}[{R}]))", "requests refused (503)"),
        ],
        "short",
    )
    panel(
        "Collector: store lag and buffers",
        [
            (
                f"sum({exposed_name('records_derived')}) - sum({exposed_name('store_records')})",
                "records derived, not yet stored",
            ),
            (
                f"sum({exposed_name('assembly_traces_in_flight')}) / sum({exposed_name('assembly_traces_limit')})",
                "traces in flight / --max-traces",
            ),
            (f"sum({exposed_name('derivation_backlog_traces')})", "derivation backlog"),
        ],
        "short",
    )
    panel(
        "Tracing's own cost: CPU by process",
        [
            (
                f"sum by (service, instance, pipeline) (rate({_tracer(sc.TRACER_CPU_TIME)}[{R}]))",
                "{{service}} {{instance}} {{pipeline}}",
            )
        ],
        "percentunit",
        description="the share of one core each traced process spends building and exporting its spans "
        f"({sc.TRACER_CPU_TIME.name}, sent by the process beside its spans; the hooks on the engine's threads "
        "are not in it)",
    )
    panel(
        "Tracing's own cost: spans exported, dropped, unsampled",
        [
            (f"sum by (service) (rate({_tracer(sc.TRACER_SPANS_EXPORTED)}[{R}]))", "{{service}} exported"),
            (f"sum by (service) (rate({_tracer(sc.TRACER_SPANS_DROPPED)}[{R}]))", "{{service}} dropped"),
            (f"sum by (service) (rate({_tracer(sc.TRACER_EVENTS_DROPPED)}[{R}]))", "{{service}} hook events dropped"),
            (
                f"sum by (service) (rate({_tracer(sc.TRACER_REQUESTS_UNSAMPLED)}[{R}]))",
                "{{service}} requests not sampled",
            ),
        ],
        "short",
        description="per second, as each traced process reports it: spans its exporter could not send and hook "
        "events its recorder had no room for are lost; unsampled requests were left out by OTEL_TRACES_SAMPLER",
    )
    return {
        "uid": "otel-llm",
        "title": "otel-llm: LLM inference latency",
        "description": "TTFT, TPOT, ITL, E2E at each boundary, the TTFT decomposition, stalls, goodput and the "
        "collector's health, from the otel-llm collector's /metrics",
        "tags": ["otel-llm", "llm", "opentelemetry"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "model",
                    "label": "model",
                    "type": "query",
                    "datasource": DS,
                    "query": {"query": f"label_values({N['requests']}, model)", "refId": "model"},
                    "definition": f"label_values({N['requests']}, model)",
                    "includeAll": True,
                    "allValue": ".*",
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                    "hide": 0,
                },
            ]
        },
        "panels": list(_panels),
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    with open(OUT, "w") as fh:
        fh.write(render())
    print(f"wrote {OUT}")
