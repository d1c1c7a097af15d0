"""Every GenAI name otel-llm emits or exports, held against the OpenTelemetry GenAI semantic
conventions as the installed ``opentelemetry-semantic-conventions`` package states them (its version
is pinned with the SDK's, and printed): a name we emit must be current, never one the conventions
replaced ("Deprecated: Replaced by ..."); a replaced name the collector still reads must have its
replacement read too; and no ``gen_ai.*`` name in the code bypasses the table in
:mod:`otel_llm.semconv`."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

from collector.pipeline.metrics_registry import MetricsRegistry
from otel_llm import semconv as sc

ROOT = Path(__file__).resolve().parents[2]
_CONST = re.compile(r'^[A-Z0-9_]+: Final = "(gen_ai\.[^"]+)"\n(?:"""\n(.*?)\n""")?', re.M | re.S)


def conventions(module: str) -> dict[str, str | None]:
    """name -> None (current) / "moved" (current, its home now the GenAI repository) / the name that
    replaced it, from one of the package's generated modules."""
    import opentelemetry.semconv as pkg

    path = Path(pkg.__file__).parent / "_incubating" / module
    out: dict[str, str | None] = {}
    for name, doc in _CONST.findall(path.read_text()):
        doc = doc or ""
        replaced = re.search(r"Replaced by `([^`]+)`", doc)
        out[name] = replaced.group(1) if replaced else ("moved" if "Deprecated" in doc else None)
    return out


@pytest.fixture(scope="module")
def attributes():
    print("opentelemetry-semantic-conventions", importlib.metadata.version("opentelemetry-semantic-conventions"))
    names = conventions("attributes/gen_ai_attributes.py")
    assert len(names) > 30 and sc.INPUT_TOKENS in names  # the package still states them
    return names


def test_every_name_we_emit_is_current(attributes):
    for name in sc.GENAI_EMITTED:
        assert name in attributes, f"{name} is not a GenAI convention name"
        assert attributes[name] in (None, "moved"), f"{name} was replaced by {attributes[name]}"


def test_every_metric_we_export_under_a_genai_name_is_current():
    """The server histograms (every boundary, by label) and the client's under the GenAI client names."""
    metrics = conventions("metrics/gen_ai_metrics.py")
    reg = MetricsRegistry()
    ours = [f.name for f in reg.families if f.name.startswith("gen_ai.")]
    assert len(ours) == 6, ours
    for name in ours:
        assert name in metrics, f"{name} is not a GenAI convention metric"
        assert metrics[name] in (None, "moved"), f"{name} was replaced by {metrics[name]}"


def test_older_names_we_accept_are_read_beside_their_replacements(attributes):
    """vLLM still sends gen_ai.usage.prompt_tokens / completion_tokens: the collector reads them,
    and the names that replaced them too. vLLM's own gen_ai.latency.* are not convention names."""
    read = set(sc.GENAI_EMITTED) | set(sc.GENAI_ACCEPTED)
    for name in sc.GENAI_ACCEPTED:
        if name in attributes and attributes[name] not in (None, "moved"):
            assert attributes[name] in read, f"{name} is read, but not {attributes[name]} that replaced it"
        elif name not in attributes:
            assert name.startswith(("gen_ai.latency.", "gen_ai.request.id")), f"{name}: whose is it?"


def test_no_genai_name_bypasses_the_table():
    """Every gen_ai.* string in the product's code is in the table (or a metric family's name)."""
    known = set(sc.GENAI_EMITTED) | set(sc.GENAI_ACCEPTED)
    metric_names = {
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
        "gen_ai.server.request.duration",
        "gen_ai.client.operation.time_to_first_chunk",
        "gen_ai.client.operation.time_per_output_chunk",
        "gen_ai.client.operation.duration",
    }
    found = {}
    for pkg in ("otel_llm", "collector", "engine_hooks", "deploy"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path.name == "semconv.py":
                continue
            for name in re.findall(r'"(gen_ai\.[a-z0-9_.]+)"', path.read_text()):
                found[name] = path
    stray = {n: str(p.relative_to(ROOT)) for n, p in found.items() if n not in known | metric_names}
    assert not stray, stray
    reg_names = {f.name for f in MetricsRegistry().families}
    assert metric_names <= reg_names


def test_the_client_boundary_under_the_genai_client_names():
    """gen_ai.client.operation.* hold the client records alone: TTFT, every chunk gap, E2E."""
    from support.otlp_helpers import Req, records, sample_request

    from collector.exporters.prometheus import render

    b, rm = records(sample_request([Req("a"), Req("b", client_events=[(100, 1), (150, 2)])]).SerializeToString())
    reg = MetricsRegistry()
    reg.record(b, rm)
    text = render(reg.families)

    def series(name: str) -> dict[str, float]:
        return {
            line.split("{")[0][len(name) + 1 :]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "_") and "_bucket" not in line
        }

    client = [r for r in b.records() if r.boundary == "client"]
    ttfc = series("gen_ai_client_operation_time_to_first_chunk_seconds")
    assert ttfc["count"] == 2 and ttfc["sum"] == pytest.approx(sum(r.ttft for r in client))
    tpoc = series("gen_ai_client_operation_time_per_output_chunk_seconds")
    assert tpoc["count"] == 3 and tpoc["sum"] == pytest.approx(0.070 + 0.050)
    dur = series("gen_ai_client_operation_duration_seconds")
    assert dur["count"] == 2 and dur["sum"] == pytest.approx(sum(r.e2e for r in client))
    assert 'gen_ai_client_operation_duration_seconds_count{boundary="engine"' not in text
