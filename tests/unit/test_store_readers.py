"""The store's readers give the numbers they gave before the record schema was rebuilt.

``tests/data`` holds a real store (one ``make demo`` run) and what ``analyze --store`` and
``compare`` printed for it at commit 94e242e; today's commands must print the same bytes (the
``analyze`` outputs were written again when the per-request metrics became exact integer-ns
arithmetic: see tests/data/README.md and the test below).
"""

import os

import pytest
from conftest import run_cli

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
STORE = os.path.join(DATA, "demo_store.db")


def _expected(name: str) -> str:
    with open(os.path.join(DATA, name)) as fh:
        return fh.read()


@pytest.fixture
def store(tmp_path):
    """A copy: opening a store may add columns, and the committed file stays as it was written."""
    import shutil

    path = str(tmp_path / "demo.db")
    shutil.copy(STORE, path)
    return path


@pytest.mark.parametrize("boundary", ["client", "engine"])
def test_analyze_store_prints_what_it_printed_before(store, boundary):
    out = run_cli(
        "analyze", "--store", store, "--boundary", boundary, "--slo", "ttft=0.05,tpot=0.01", "--format", "json"
    ).stdout
    assert out == _expected(f"demo_store.analyze-{boundary}.json")


def test_analyze_store_percentiles_are_exact_nanoseconds(store):
    """Nearest-rank percentiles of TTFT and E2E from a store are a record's own ns difference,
    converted once: no float64-Unix-seconds rounding (it moved them by up to 0.1 us)."""
    import json

    from collector.storage.store import open_existing

    s = open_existing(store)
    recs = s.batch("client").records()
    s.close()
    ttfts = {r.event_offsets_ns[0] / 1e9 for r in recs}
    e2es = {(r.end_ns - r.submit_ns) / 1e9 for r in recs}
    out = json.loads(run_cli("analyze", "--store", store, "--format", "json").stdout)
    lat = out["latency"]
    for key in ("p50", "p90", "p99", "min", "max"):
        assert lat["ttft"][key] in ttfts and lat["e2e"][key] in e2es, key


def test_compare_prints_what_it_printed_before(store):
    fixed = ("--stall", "0.01", "--stall-factor", "0")  # the threshold as it was: one number for every request
    assert run_cli("compare", "--store", store, "--format", "json", *fixed).stdout == _expected(
        "demo_store.compare.json"
    )
    assert run_cli("compare", "--store", store, *fixed).stdout == _expected("demo_store.compare.txt")


def test_the_store_round_trips_through_the_batch(store):
    from collector.pipeline.records import RecordBatch
    from collector.storage.store import RequestStore

    s = RequestStore(store)
    batch = s.batch()
    again = RecordBatch.from_records(batch.records())
    for name in batch.scalar_columns():
        assert batch.scalar_columns()[name] == again.scalar_columns()[name], name
    assert batch.event_offsets_ns.tolist() == again.event_offsets_ns.tolist()
    assert batch.event_tokens.tolist() == again.event_tokens.tolist()
    assert s.add(again) == 0  # nothing new: every row is already there
    assert set(batch.service) == {None}  # a column this store's writer did not have: unknown in its rows
    s.close()
