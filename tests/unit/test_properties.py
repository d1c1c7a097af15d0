"""Invariants of the metric core, checked with hypothesis."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_llm import SLO, Timeline, TimelineBatch, Window, percentiles, request_metrics, summarize
from otel_llm.metrics.percentiles import nearest_rank_index
from otel_llm.metrics.timeline import STATUS_CODE, STATUSES

times = st.floats(min_value=0, max_value=100, allow_nan=False, allow_infinity=False)


@st.composite
def timelines(draw):
    n = draw(st.integers(1, 12))
    out = []
    for i in range(n):
        submit = draw(times)
        evs = draw(st.lists(st.tuples(st.floats(0, 20, allow_nan=False), st.integers(1, 4)), max_size=8))
        last = max([submit + dt for dt, _ in evs], default=submit)
        end = last + draw(st.floats(0, 5, allow_nan=False))
        out.append(
            Timeline(
                id=str(i),
                submit=submit,
                end=end,
                status=draw(st.sampled_from(STATUSES)),
                events=tuple((submit + dt, k) for dt, k in evs),
            )
        )
    return out


slos = st.builds(
    SLO,
    ttft=st.one_of(st.none(), st.floats(0, 10)),
    tpot=st.one_of(st.none(), st.floats(0, 2)),
    itl_max=st.one_of(st.none(), st.floats(0, 10)),
    e2e=st.one_of(st.none(), st.floats(0, 30)),
    tpot_undefined=st.sampled_from(["pass", "fail"]),
)


@settings(max_examples=200, deadline=None)
@given(timelines(), slos)
def test_goodput_le_throughput_and_attainment_in_unit_interval(tls, slo):
    s = summarize(TimelineBatch.from_timelines(tls), slo=slo)
    g = s.goodput
    assert g.good <= s.counts.completed
    if s.requests_per_s is not None:
        assert g.requests_per_s <= s.requests_per_s
    if g.attainment is not None:
        assert 0 <= g.attainment <= 1
        for v in g.attainment_by_bound.values():
            assert 0 <= v <= 1
            assert g.attainment <= v  # meeting all bounds is rarer than meeting one
    else:
        assert s.counts.completed == 0


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=60),
    st.decimals(0, 100, places=3, allow_nan=False, allow_infinity=False),
)
def test_nearest_rank_is_always_a_sample(xs, p):
    [v] = percentiles(np.array(xs), [str(p)], "nearest-rank")
    assert v in xs
    # and it is the smallest sample with at least p% of samples <= it
    n = len(xs)
    assert sum(x <= v for x in xs) * 100 >= float(p) * n - 1e-9


def test_nearest_rank_exact_rank():
    assert nearest_rank_index(7, 100) == 6  # rank 7, not 8 (7 * 100 / 100 in floats is 7.000000000000001)
    assert nearest_rank_index("0.07", 10000) == 6
    assert nearest_rank_index(99.9, 1000) == 998
    assert nearest_rank_index(0, 5) == 0
    assert nearest_rank_index(100, 5) == 4
    assert percentiles(np.arange(1, 101), [7, 50, 99.9])[0] == 7


@settings(max_examples=150, deadline=None)
@given(timelines(), st.randoms())
def test_order_of_events_and_requests_irrelevant(tls, rnd):
    """Requests in any order, and every event of the batch in any order, give the same summary.
    The events go in through ``TimelineBatch.from_columns``, which takes them unsorted (a
    ``Timeline`` sorts its own when it is made, so shuffling those tests nothing)."""
    order = list(range(len(tls)))
    rnd.shuffle(order)
    flat = [(j, t, k) for j, i in enumerate(order) for t, k in tls[i].events]
    rnd.shuffle(flat)
    shuffled = TimelineBatch.from_columns(
        [tls[i].id for i in order],
        [tls[i].submit for i in order],
        [tls[i].end for i in order],
        [STATUS_CODE[tls[i].status] for i in order],
        [j for j, _, _ in flat],
        [t for _, t, _ in flat],
        [k for _, _, k in flat],
    )
    a = summarize(TimelineBatch.from_timelines(tls), slo=SLO(ttft=1, tpot=0.5)).to_json()
    b = summarize(shuffled, slo=SLO(ttft=1, tpot=0.5)).to_json()
    assert a == b


@settings(max_examples=150, deadline=None)
@given(timelines())
def test_window_edges_inclusive(tls):
    batch = TimelineBatch.from_timelines(tls)
    ends = sorted({t.end for t in tls})
    w = Window(min(t.submit for t in tls), ends[0])  # window closing exactly at the earliest end
    s = summarize(batch, window=w)
    expected = sum(1 for t in tls if t.status == "ok" and w.start <= t.end <= w.end)
    assert s.counts.completed == expected
    toks = sum(k for t in tls for (et, k) in t.events if w.start <= et <= w.end)
    assert s.output_tokens_in_window == toks


@settings(max_examples=150, deadline=None)
@given(timelines())
def test_vectorised_matches_per_request_definition(tls):
    rm = request_metrics(TimelineBatch.from_timelines(tls))
    itl_all = []
    for i, t in enumerate(tls):
        ts = [e[0] for e in t.events]
        n_tok = sum(e[1] for e in t.events)
        if ts:
            assert rm.ttft[i] == pytest.approx(ts[0] - t.submit)
        else:
            assert np.isnan(rm.ttft[i])
        if n_tok > 1:
            assert rm.tpot[i] == pytest.approx((ts[-1] - ts[0]) / (n_tok - 1))
        else:
            assert np.isnan(rm.tpot[i])
        gaps = [b - a for a, b in itertools.pairwise(ts)]
        itl_all += gaps
        if gaps:
            assert rm.itl_max[i] == pytest.approx(max(gaps))
        else:
            assert np.isnan(rm.itl_max[i])
        assert rm.e2e[i] == pytest.approx(t.end - t.submit)
    assert rm.itl.tolist() == pytest.approx(itl_all)
