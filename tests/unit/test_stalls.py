"""Stall causes (collector/pipeline/stalls.py), as the docs define them: the client's largest gap between
token events is a stall when over max(0.1 s, 4 x the median of the request's other gaps). The stall belongs to
the first layer where at least half of it already shows over the same two tokens: the engine core
(its generation times; preempted or not), the API server (the engine handed the token out late
although the core had it, or the HTTP server wrote it late), else what came after the server wrote
it (network/client); without the server span those last two are one (delivery). Counted by cause
on the collector's metrics, and the same in otel-llm compare."""

from __future__ import annotations

import pytest
from support.otlp_helpers import Req, sample_request

from collector.config import CollectorConfig
from collector.exporters.prometheus import render
from collector.service import Collector

N, STEP, AT, GAP = 12, 30, 6, 270  # 12 tokens 30 ms apart; a 270 ms gap before the 7th


def stream(start: float, gap: bool) -> list[float]:
    """Token times (ms): every STEP, and GAP instead before token AT when ``gap``."""
    out, t = [], start
    for i in range(N):
        out.append(t)
        t += GAP if gap and i == AT - 1 else STEP
    return out


def req(rid: str, core: bool, out: bool, server: bool | None, client: bool = True, **kw) -> Req:
    """A request whose gap shows at the engine core (``core``), the engine's token events
    (``out``), the server's writes (``server``; None: no server span) and the client."""
    gen = stream(80, core)
    ev = stream(85, out)
    cl = stream(100, client)
    chunks = None if server is None else stream(90, server)
    return Req(
        rid,
        client_events=[(t, 1) for t in cl],
        client_end=cl[-1] + 10,
        engine_events=[(t, 1) for t in ev],
        engine_end=ev[-1] + 5,
        generated=gen,
        server_received=None if server is None else 5,
        server_chunks=chunks or [],
        **kw,
    )


CASES = {
    # the engine core generated the 7th token 270 ms after the 6th
    "engine:other": req("o", True, True, True),
    # the same, and the engine preempted the request meanwhile
    "engine:preemption": req("p", True, True, True, preemptions=[(240, 480)]),
    # the core had it on time; the engine handed it out 270 ms late (the API server's output processing)
    "api_server": req("a", False, True, True),
    # handed out on time; the HTTP server wrote it late
    "api_server:write": req("w", False, False, True),
    # written on time; the client got it late
    "network/client": req("n", False, False, False),
    # no server span: after the engine, unresolved
    "delivery": req("d", False, False, None),
    # a 60 ms gap is under max(0.1 s, 4 x 30 ms)
    "none": Req(
        "z",
        client_events=[(100 + 30 * i + (30 if i >= 6 else 0), 1) for i in range(N)],
        client_end=500,
        engine_events=[(85 + 30 * i, 1) for i in range(N)],
        engine_end=450,
    ),
}
CLASSES = ("network/client", "api_server", "delivery", "engine:preemption", "engine:other")


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


@pytest.mark.parametrize("case", list(CASES))
def test_each_cause_is_recognised_and_counted(case):
    cause = case.split(":write")[0]
    c = collector()
    c.accept(sample_request([CASES[case]]).SerializeToString())
    c.process(c.assembler.flush())
    got = scrape(c)
    for k in CLASSES:
        want = 1 if k == cause else 0
        assert got[f"llm_stalls_total:{k}"] == want, (k, got)
        assert got[f"llm_stall_seconds_total:{k}"] == pytest.approx(GAP / 1e3 if want else 0.0)


def test_the_threshold_follows_the_requests_own_pace():
    """A 270 ms gap in a stream whose tokens come every 80 ms is under 4 x 80 ms: no stall; with
    --stall-factor 0 the floor alone decides and it is one."""
    slow = Req(
        "s",
        client_events=[(100 + 80 * i + (190 if i >= 6 else 0), 1) for i in range(N)],
        client_end=1200,
        engine_events=[(85 + 80 * i, 1) for i in range(N)],
        engine_end=1100,
    )
    for factor, want in ((4.0, 0), (0.0, 1)):
        c = Collector(CollectorConfig(otlp_grpc=None, otlp_http=None, prometheus=None, store=None, stall_factor=factor))
        c.accept(sample_request([slow]).SerializeToString())
        c.process(c.assembler.flush())
        assert scrape(c)["llm_stalls_total:delivery"] == want


def test_compare_gives_the_same_causes(tmp_path):
    """otel-llm compare classifies with the same function: the same request, the same cause."""
    from collector.analysis.compare import compare
    from collector.config import CollectorConfig as CC

    c = Collector(CC(otlp_grpc=None, otlp_http=None, prometheus=None, store=str(tmp_path / "s.db")))
    c.accept(sample_request(list(CASES.values())).SerializeToString())
    c.process(c.assembler.flush())
    c.store_writer.drain()
    stored = c.store.records()
    rows = {r.id: r for r in compare(stored).rows}
    c.stop()
    assert {case: rows[r.id].stall for case, r in CASES.items()} == {k: k.split(":write")[0] for k in CASES}
    assert rows["d"].stall_gap == pytest.approx(GAP / 1e3)
    # the layers' own gaps over the two tokens, stored with the client record
    cl = {r.request_id: r for r in stored if r.boundary == "client"}
    assert cl["o"].stall_core_gap == pytest.approx(GAP / 1e3) and cl["o"].stall_server_gap == pytest.approx(GAP / 1e3)
    assert cl["a"].stall_core_gap == pytest.approx(STEP / 1e3) and cl["a"].stall_server_gap == pytest.approx(GAP / 1e3)
    assert cl["n"].stall_core_gap == pytest.approx(STEP / 1e3) and cl["n"].stall_server_gap == pytest.approx(STEP / 1e3)
    assert cl["d"].stall_server_gap is None and cl["z"].stall_core_gap is None


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

    from collector.pipeline.stalls import engine_gap, refine_engine_stall
    from collector.pipeline.steps import StepBatch

    ms = 1_000_000

    def steps(rows, drafts=None):  # (start ms, end ms, batch, prefill tokens); drafts: (drafted, accepted) per row
        n = len(rows)
        drafted, accepted = zip(*drafts) if drafts else ([-1] * n, [-1] * n)
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
            draft_tokens=np.array(drafted, np.int64),
            accepted_tokens=np.array(accepted, np.int64),
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
    # speculative decoding: a long verify step that accepted fewer than half its drafts; one that
    # accepted most of them, or a short one, is not the cause
    verify = sorted(idle + [(100, 215, 4, 0)])
    at = verify.index((100, 215, 4, 0))

    def with_drafts(d, a, rows=verify, i=at):
        return [(d, a) if k == i else (4, 3) for k in range(len(rows))]

    assert refine_engine_stall(gap, steps(verify, with_drafts(16, 7)), median) == "engine:rejected-drafts"
    assert refine_engine_stall(gap, steps(verify, with_drafts(16, 8)), median) == "engine:other"
    assert refine_engine_stall(gap, steps(verify, with_drafts(-1, -1)), median) == "engine:other"
    short = sorted(regular[:10] + [(100, 109, 4, 0)] + regular[22:])
    assert refine_engine_stall(gap, steps(short, [(0, 0)] * len(short)), median) == "engine:idle"
    assert refine_engine_stall((100 * ms, 110 * ms), steps(short, with_drafts(16, 0, short, 10)), median) == (
        "engine:other"
    )
    # the gap is the engine's own, at the token where the client's largest gap ends
    from types import SimpleNamespace as R

    client = R(event_offsets_ns=[10 * ms, 20 * ms, 300 * ms, 310 * ms], submit_ns=0)
    engine = R(event_offsets_ns=[5 * ms, 15 * ms, 290 * ms, 300 * ms], submit_ns=1000)
    assert engine_gap(client, engine) == (1000 + 15 * ms, 1000 + 290 * ms)


def test_hostile_layer_arrays_do_no_harm():
    """Server chunk times out of order, generation times of another length than the token events,
    a generation array of odd bytes: the records are derived, the layers they cannot support are
    unknown, and nothing raises."""
    from collector.pipeline.assembly import ReleasedTrace
    from collector.pipeline.derive import derive
    from collector.pipeline.walked_span import make_span
    from otel_llm import semconv as sc

    t, ms = "cd" * 16, 1_000_000
    ev = [100 * ms + 30 * ms * i for i in range(6)]
    spans = [
        make_span(
            t, "c1" * 8, sc.SPAN_CLIENT_REQUEST, start=0, end=400 * ms, request_id="r", offsets=ev, tokens=[1] * 6
        ),
        make_span(
            t,
            "5e" * 8,
            "POST /v1/completions",
            parent="c1" * 8,
            start=1,
            end=390 * ms,
            chunk_offsets=[300 * ms, 90 * ms, 200 * ms, 120 * ms],
        ),
        make_span(
            t,
            "e1" * 8,
            sc.SPAN_REQUEST,
            parent="5e" * 8,
            start=2 * ms,
            end=380 * ms,
            request_id="r",
            offsets=[x - 10 * ms for x in ev],
            tokens=[1] * 6,
            gen_offsets=[5 * ms, 6 * ms],
            gen_tokens=b"\x01",
        ),
    ]
    batch, _ = derive([ReleasedTrace(bytes.fromhex(t), spans, "grace")])
    recs = {r.boundary: r for r in batch.records()}
    assert set(recs) == {"client", "server", "engine"}
    c = recs["client"]
    assert c.stall_core_gap is None  # two generations for six token events: not a mapping
    assert c.stall_server_gap is not None and c.stall_server_gap >= 0  # the chunks, sorted, still say something
    assert list(recs["server"].event_offsets_ns) == sorted(recs["server"].event_offsets_ns)


def test_the_breakdown_page_lists_every_cause_as_declared():
    """docs/metrics/breakdown.md's table of causes is stalls.CAUSES: the same causes, each with what
    its row says of where it shows and what it holds."""
    from pathlib import Path

    from collector.pipeline.stalls import CAUSES

    text = (Path(__file__).resolve().parents[2] / "docs" / "metrics" / "breakdown.md").read_text()
    section = text[text.index("## A cause for every stall") :]
    table = section[section.index("| cause |") : section.index("\n\n", section.index("| cause |"))]
    cells = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in table.splitlines()[2:]]
    rows = {name.strip("`"): (shows, holds) for name, shows, holds in cells}
    assert rows == {c.name: (c.shows, c.holds) for c in CAUSES}
