"""Stall causes (collector/stalls.py), as the docs define them: the client's largest gap over the
threshold is a stall; if the engine's gap before the same token is at least half of it, the engine
was late (preemption if the request was preempted, other otherwise), else the time went after
the engine (delivery). Counted by cause on the collector's metrics."""

from __future__ import annotations

import pytest
from otlp_helpers import Req, sample_request

from collector.config import CollectorConfig
from collector.exporters.prometheus import render
from collector.service import Collector

MS = [(100, 1), (130, 1)]


def collector():
    return Collector(CollectorConfig(otlp_grpc=None, otlp_http=None, prometheus=None, store=None))


def scrape(c) -> dict[str, float]:
    txt = render(c.registry.snapshot(), c.self_counters())
    out = {}
    for line in txt.splitlines():
        if line.startswith(("llm_stalls_total", "llm_stall_seconds_total")):
            name, v = line.rsplit(" ", 1)
            cause = name.split('cause="')[1].split('"')[0]
            out[name.split("{")[0] + ":" + cause] = float(v)
    return out


CASES = {
    # the client waits 270 ms for its third token; the engine generated it 265 ms after the second
    "engine:other": Req(
        "o", client_events=[*MS, (400, 1)], client_end=410, engine_events=[(85, 1), (115, 1), (380, 1)], engine_end=390
    ),
    # the same, and the engine preempted the request meanwhile
    "engine:preemption": Req(
        "p",
        client_events=[*MS, (400, 1)],
        client_end=410,
        engine_events=[(85, 1), (115, 1), (380, 1)],
        engine_end=390,
        preemptions=[(120, 370)],
    ),
    # the engine had the third token 35 ms after the second: the 270 ms went after it
    "delivery": Req(
        "d", client_events=[*MS, (400, 1)], client_end=410, engine_events=[(85, 1), (115, 1), (150, 1)], engine_end=160
    ),
    # 60 ms gaps are under the 100 ms threshold
    "none": Req(
        "n", client_events=[*MS, (190, 1)], client_end=200, engine_events=[(85, 1), (115, 1), (175, 1)], engine_end=180
    ),
}


@pytest.mark.parametrize("cause", list(CASES))
def test_each_cause_is_recognised_and_counted(cause):
    c = collector()
    c.accept(sample_request([CASES[cause]]).SerializeToString())
    c.process(c.assembler.flush())
    got = scrape(c)
    for k in ("delivery", "engine:preemption", "engine:other"):
        want = 1 if k == cause else 0
        assert got[f"llm_stalls_total:{k}"] == want
        assert got[f"llm_stall_seconds_total:{k}"] == pytest.approx(0.270 if want else 0.0)


def test_compare_gives_the_same_causes(tmp_path):
    """otel-llm compare classifies with the same function: the same request, the same cause."""
    from collector.compare import compare
    from collector.config import CollectorConfig as CC

    c = Collector(CC(otlp_grpc=None, otlp_http=None, prometheus=None, store=str(tmp_path / "s.db")))
    c.accept(sample_request(list(CASES.values())).SerializeToString())
    c.process(c.assembler.flush())
    c.store_writer.drain()
    rows = {r.id: r for r in compare(c.store.records(), None, 0.1).rows}
    c.stop()
    assert {cause: rows[req.id].stall for cause, req in CASES.items()} == {k: k for k in CASES}
    assert rows["d"].stall_gap == pytest.approx(0.270)


def test_merged_chunks_fall_back_to_the_engines_largest_gap():
    """The client got two tokens in one chunk (fewer gaps than the engine): the engine's largest
    gap stands in for the gap at the same token."""
    c = collector()
    r = Req(
        "m",
        client_events=[(100, 1), (400, 2)],
        client_end=410,
        engine_events=[(85, 1), (115, 1), (380, 1)],
        engine_end=390,
    )
    c.accept(sample_request([r]).SerializeToString())
    c.process(c.assembler.flush())
    assert scrape(c)["llm_stalls_total:engine:other"] == 1
