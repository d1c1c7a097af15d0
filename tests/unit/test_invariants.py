"""Timeline invariants: hand-made spans that break each ordering, through a real collector, are
stored with the kinds they break and counted on /metrics; a clean request breaks none; nothing
is clamped to 0. The engine hooks keep an out-of-order token where it was and say so."""

from __future__ import annotations

import time

import numpy as np
from support.otlp_helpers import Req, metrics_text, sample_request

from collector.pipeline.invariants import KINDS
from engine_hooks.spans.span_factory import _broken_orderings
from engine_hooks.spans.tracker import FinishedRequest
from otel_llm import semconv as sc

CASES = {
    "clean": (Req("clean", server_received=5, server_chunks=[90, 120, 160]), set()),
    "token_early": (Req("early", engine_events=[(5, 1), (115, 1)]), {"events_outside_record"}),
    "scheduled_early": (Req("sched", first_scheduled=5), {"scheduled_before_arrival"}),
    "handed_out_early": (Req("out", engine_events=[(70, 1), (115, 1), (155, 1)]), {"handed_out_before_generated"}),
    "server_late": (
        Req("srv", server_received=15, server_chunks=[90, 120, 160]),
        {"arrival_before_server_received"},
    ),
    "client_fast": (
        Req("cl", client_events=[(40, 1), (130, 1), (170, 1)], server_received=5, server_chunks=[90, 120, 160]),
        {"client_ttft_below_server"},
    ),
    "hooks_said": (Req("said", engine_attrs={sc.TIMELINE_VIOLATIONS: "queued_before_arrival,nonsense"}), set()),
}


def _stored(c, n):
    deadline = time.monotonic() + 10
    while c.records_derived < n and time.monotonic() < deadline:
        time.sleep(0.05)
    c.store_writer.drain()
    return c.store.records()


def test_each_broken_ordering_is_stored_and_counted(make_collector):
    c = make_collector()
    c.accept(sample_request([req for req, _ in CASES.values()]).SerializeToString())
    n = sum(3 if r.server_received is not None else 2 for r, _ in CASES.values())
    records = _stored(c, n)
    kinds: dict[str, set] = {}
    for r in records:
        kinds.setdefault(r.request_id, set()).update((r.violations or "").split(",") if r.violations else ())
    for name, (req, want) in CASES.items():
        got = kinds[req.id] - ({"queued_before_arrival"} if name == "hooks_said" else set())
        assert got == want, name
    assert kinds["said"] == {"queued_before_arrival"}  # the hooks' word, unknown kinds left out
    early = next(r for r in records if r.request_id == "early" and r.boundary == "engine")
    assert early.ttft is None and early.events_rejected == 2  # unknown, not 0
    text = metrics_text(c)
    for kind in ("events_outside_record", "scheduled_before_arrival", "client_ttft_below_server"):
        assert f'kind="{kind}"' in text
    assert set(KINDS) >= {k for ks in kinds.values() for k in ks}
    # analyze says how many records of the boundary it reads broke which ordering (compare lists them)
    import json

    from conftest import run_cli

    engine = json.loads(
        run_cli("analyze", "--store", c.config.store, "--boundary", "engine", "--format", "json").stdout
    )
    broken = [r for r in records if r.boundary == "engine" and r.violations]
    assert engine["timeline_violations"]["records"] == len(broken) == 5  # early, sched, out, srv, said
    assert engine["timeline_violations"]["scheduled_before_arrival"] == 1
    table = run_cli("analyze", "--store", c.config.store, "--boundary", "client").stdout
    assert "timeline violations: 1 records (client_ttft_below_server 1;" in table


def test_the_hooks_keep_a_token_before_arrival_and_say_so():
    r = FinishedRequest("r", 1_000, 2_000, "ok")
    r.out_times_ns, r.out_tokens = np.array([900, 1_500]), np.array([1, 1])
    r.queued_ns = 950
    assert _broken_orderings(r) == ["token_before_arrival", "queued_before_arrival"]
    r.out_times_ns, r.queued_ns = np.array([1_100, 1_500]), 1_050
    assert _broken_orderings(r) == []


def test_a_response_not_streamed_keeps_its_tokens_without_a_ttft(make_collector, tmp_path):
    """instrument_openai with stream=False records usage and no token events: the client record has
    its output tokens (it had 0), no TTFT (never E2E or 0), and analyze's token throughput counts
    them at the response's end."""
    import json

    from conftest import run_cli

    c = make_collector()
    reqs = [Req(f"whole{i}", client_events=[], engine=False, client_attrs={sc.OUTPUT_TOKENS: 8}) for i in range(4)]
    c.accept(sample_request(reqs).SerializeToString())
    records = _stored(c, 4)
    assert [(r.output_tokens, r.ttft, r.tpot) for r in records] == [(8, None, None)] * 4
    c.stop()
    out = json.loads(run_cli("analyze", "--store", c.config.store, "--format", "json").stdout)
    assert out["throughput"]["output_tokens"] == 32 and out["throughput"]["output_tokens_per_s"] > 0
