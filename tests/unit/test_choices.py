"""A request with several choices (n > 1) is one record per choice at each boundary, ``#k`` after
its request id, and each client choice pairs with the engine's child request for the same choice."""

import pytest

from collector.pipeline.assembly import ReleasedTrace
from collector.pipeline.derive import derive
from collector.pipeline.walked_span import make_span
from otel_llm import semconv as sc

MS = 1_000_000
T = "ab" * 16


def _trace(engine_order):
    client = [
        make_span(
            T,
            "c0" * 8,
            sc.SPAN_CLIENT_REQUEST,
            start=0,
            end=100 * MS,
            request_id="X",
            choice=0,
            offsets=[40 * MS, 50 * MS],
            tokens=[1, 1],
        ),
        make_span(
            T,
            "c1" * 8,
            sc.SPAN_CLIENT_REQUEST,
            parent="c0" * 8,
            start=0,
            end=100 * MS,
            request_id="X",
            choice=1,
            offsets=[45 * MS, 60 * MS, 70 * MS],
            tokens=[1, 1, 1],
        ),
    ]
    engines = {
        0: make_span(
            T,
            "e0" * 8,
            sc.SPAN_REQUEST,
            parent="c0" * 8,
            start=2 * MS,
            end=90 * MS,
            request_id="X",
            choice=0,
            offsets=[30 * MS, 40 * MS],
            tokens=[1, 1],
        ),
        1: make_span(
            T,
            "e1" * 8,
            sc.SPAN_REQUEST,
            parent="c0" * 8,
            start=3 * MS,
            end=90 * MS,
            request_id="X",
            choice=1,
            offsets=[35 * MS, 50 * MS, 60 * MS],
            tokens=[1, 1, 1],
        ),
    }
    plain = [  # a request of one choice in another trace of the same batch
        make_span(
            "cd" * 16,
            "d0" * 8,
            sc.SPAN_CLIENT_REQUEST,
            start=0,
            end=50 * MS,
            request_id="Y",
            offsets=[20 * MS],
            tokens=[1],
        ),
        make_span(
            "cd" * 16,
            "f0" * 8,
            sc.SPAN_REQUEST,
            parent="d0" * 8,
            start=1 * MS,
            end=40 * MS,
            request_id="Y",
            offsets=[10 * MS],
            tokens=[1],
        ),
    ]
    spans = client + [engines[k] for k in engine_order]
    return [ReleasedTrace(bytes.fromhex(T), spans, "grace"), ReleasedTrace(bytes.fromhex("cd" * 16), plain, "grace")]


@pytest.mark.parametrize("engine_order", [(0, 1), (1, 0)])
def test_each_choice_pairs_with_its_own_engine_request(engine_order, tmp_path):
    batch, _ = derive(_trace(engine_order))
    recs = {(r.boundary, r.request_id): r for r in batch.records()}
    assert set(recs) == {(b, i) for b in ("client", "engine") for i in ("X#0", "X#1", "Y")}
    for k, n in ((0, 2), (1, 3)):
        c, e = recs[("client", f"X#{k}")], recs[("engine", f"X#{k}")]
        assert c.choice == e.choice == k and c.peer_request_id == e.request_id and e.peer_request_id == c.request_id
        assert c.output_tokens == e.output_tokens == n
        assert c.to_engine == pytest.approx((2 + k) / 1000)  # from its own engine request's arrival
    assert recs[("client", "Y")].paired and recs[("client", "Y")].choice is None
    from collector.storage.store import RequestStore

    s = RequestStore(str(tmp_path / "c.db"))
    assert s.add(batch) == 6 and s.duplicates == 0  # both choices kept (one was dropped as a duplicate)
    s.close()
