"""The collector's metric families are declared once (collector.pipeline.metrics_registry.FAMILIES): the
registry exports exactly those, in that order, each as its kind, and the docs name every one of
them by the name Prometheus shows."""

from __future__ import annotations

from pathlib import Path

from collector.exporters.prometheus import prom_name
from collector.pipeline.metrics_registry import FAMILIES, Counter, Histogram, MetricsRegistry
from otel_llm.metrics.fluidity import FluidityTarget

ROOT = Path(__file__).resolve().parents[2]


def test_the_registry_exports_what_is_declared_in_order():
    plain, fluid = MetricsRegistry(), MetricsRegistry(fluidity=FluidityTarget(ttft=1.0, tbt=0.1))
    assert [f.name for f in fluid.families] == [f.name for f in FAMILIES]
    assert [f.name for f in plain.families] == [f.name for f in FAMILIES if f.when is None]
    assert not hasattr(plain, "fluidity_index")  # an option's family exists only with the option
    for f in FAMILIES:
        got = getattr(fluid, f.attr)
        assert isinstance(got, Histogram if f.buckets is not None else Counter), f.attr
        assert (got.name, got.unit, got.description) == (f.name, f.unit, f.help)
        assert got.label_names == ("boundary", "model", *f.labels)
    assert len({f.name for f in FAMILIES}) == len({f.attr for f in FAMILIES}) == len(FAMILIES)


def test_the_docs_name_every_family():
    text = (ROOT / "docs" / "viewing.md").read_text()
    missing = [n for f in FAMILIES if (n := prom_name(f.name, f.unit, counter=f.buckets is None)) not in text]
    assert missing == [], f"docs/viewing.md does not name {missing}"
