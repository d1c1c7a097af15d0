"""The store's readers give the numbers they gave before the record schema was rebuilt.

``tests/data`` holds a real store (one ``make demo`` run) and what ``analyze --store`` and
``compare`` printed for it at commit 94e242e; today's commands must print the same bytes.
"""

import os

import pytest
from conftest import run_cli

DATA = os.path.join(os.path.dirname(__file__), "data")
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


def test_compare_prints_what_it_printed_before(store):
    assert run_cli("compare", "--store", store, "--format", "json", "--stall", "0.01").stdout == _expected(
        "demo_store.compare.json"
    )
    assert run_cli("compare", "--store", store, "--stall", "0.01").stdout == _expected("demo_store.compare.txt")


def test_the_store_round_trips_through_the_batch(store):
    from collector.records import RecordBatch
    from collector.store import RequestStore

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
