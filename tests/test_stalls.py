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


def test_engine_stalls_are_refined_from_the_steps():
    """With the engine's steps, engine:other says why: a batch-mate's long prefill step in the gap
    (engine:prefill), the batch growing (engine:batch), no step running (engine:idle); a gap the
    steps explain by none of these stays engine:other."""
    import numpy as np

    from collector.stalls import engine_gap, refine_engine_stall
    from collector.steps import StepBatch

    ms = 1_000_000

    def steps(rows):  # (start ms, end ms, batch, prefill tokens)
        n = len(rows)
        return StepBatch(
            trace_id=["s"] * n,
            span_id=[str(i) for i in range(n)],
            service=["vllm"] * n,
            start_ns=np.array([a * ms for a, *_ in rows]),
            end_ns=np.array([b * ms for _, b, *_ in rows]),
            step_index=np.arange(n),
            batch_size=np.array([r[2] for r in rows]),
            prefill_tokens=np.array([r[3] for r in rows]),
            decode_tokens=np.ones(n, np.int64),
            preempted=np.zeros(n, np.int64),
            kv_usage=np.full(n, 0.5),
            gpu_time_ns=np.full(n, -1),
        )

    regular = [(t, t + 9, 4, 0) for t in range(0, 300, 10)]  # 9 ms decode steps, batch of 4
    gap = (100 * ms, 220 * ms)
    median = 9 * ms
    assert refine_engine_stall(gap, steps(regular), median) == "engine:other"
    prefill = [r for r in regular if not 100 <= r[0] < 220] + [(100, 215, 5, 480)]
    assert refine_engine_stall(gap, steps(sorted(prefill)), median) == "engine:prefill"
    grown = [(a, b, 8 if a >= 100 else 4, p) for a, b, _, p in regular]
    assert refine_engine_stall(gap, steps(grown), median) == "engine:batch"
    idle = [r for r in regular if not 100 <= r[0] < 220]
    assert refine_engine_stall(gap, steps(idle), median) == "engine:idle"
    # the gap is the engine's own, at the token where the client's largest gap ends
    from types import SimpleNamespace as R

    client = R(event_offsets_ns=[10 * ms, 20 * ms, 300 * ms, 310 * ms], submit_ns=0)
    engine = R(event_offsets_ns=[5 * ms, 15 * ms, 290 * ms, 300 * ms], submit_ns=1000)
    assert engine_gap(client, engine) == (1000 + 15 * ms, 1000 + 290 * ms)
