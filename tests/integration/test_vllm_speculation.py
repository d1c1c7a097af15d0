"""Speculative decoding in a real vLLM (the CPU build): every verify step is a decode step, and
the step spans' draft and accepted tokens are vLLM's own counts.

vLLM's truth: ``per_request_spec_decode_metrics="detailed"`` (each request's verify steps, drafted
and accepted) and its run counters ``vllm:spec_decode_num_draft_tokens`` and
``..._accepted_tokens``. The scenario runs in its own process (tests/support/vllm_scenarios.py).
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from conftest import run_cli, run_vllm_scenario, start_vllm_server

from collector.analysis.offline import read_trace_file as derive_trace_file
from collector.exporters.prometheus import render
from collector.pipeline.assembly import AssemblyConfig
from engine_hooks.tiny_model import stop_cpu_server
from otel_llm import semconv as sc
from otel_llm.otlp.trace_file import read_trace_requests

pytestmark = [pytest.mark.slow, pytest.mark.parallel_safe]

#: the scenarios' n-gram speculation (not imported from tests/support/vllm_scenarios.py: importing
#: it sets VLLM_LOGGING_LEVEL for every server this test process starts after)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_step_spans_count_verify_steps_as_decode_with_vllms_draft_counts(tmp_path, tiny_model, method, make_collector):
    truth, spans = run_vllm_scenario(tmp_path, f"spec-{method}", tiny_model, env={"OTEL_LLM_DETAIL": "steps"})
    reqs = truth["requests"]
    counters = truth["counters"]
    drafted = sum(sum(r["drafted"]) for r in reqs)
    accepted = sum(sum(r["accepted"]) for r in reqs)
    # vLLM's per-request account and its counters agree, and speculation happened
    assert drafted == counters["vllm:spec_decode_num_draft_tokens"] > 0
    assert accepted == counters["vllm:spec_decode_num_accepted_tokens"] > 0
    if method == "draft":  # the model as its own draft: every draft accepted
        assert accepted == drafted
    else:  # n-gram on a random model: some accepted, not all
        assert 0 < accepted < drafted

    steps = [s for s in spans if s.name == sc.SPAN_STEP]
    verify = [s for s in steps if sc.STEP_DRAFT_TOKENS in s.attributes]
    # the step spans' totals are vLLM's counters, exactly
    assert sum(s.attributes[sc.STEP_DRAFT_TOKENS] for s in verify) == drafted
    assert sum(s.attributes[sc.STEP_ACCEPTED_TOKENS] for s in verify) == accepted
    # a step without drafts says nothing of speculation (not a zero)
    assert all(sc.STEP_ACCEPTED_TOKENS not in s.attributes for s in steps if s not in verify)
    assert max(len(r["drafted"]) for r in reqs) <= len(verify)
    # the collector keeps them in its steps table, unknown (-1) where a step verified none
    records, table = derive_trace_file(str(tmp_path / f"spec-{method}.jsonl"))
    assert len(records) == len(reqs) and len(table) == len(steps)
    said = table.draft_tokens >= 0
    assert int(table.draft_tokens[said].sum()) == drafted and int(table.accepted_tokens[said].sum()) == accepted
    assert (table.accepted_tokens[~said] == -1).all()

    roots = {s.attributes[sc.REQUEST_ID]: s for s in spans if s.name == sc.SPAN_REQUEST}
    assert set(roots) == {r["id"] for r in reqs}
    events = {rid: root.attributes[sc.TOKEN_EVENT_TOKENS] for rid, root in roots.items()}
    for r in reqs:  # every token the caller got, in events of 1 to 1 + k tokens
        assert sum(events[r["id"]]) == r["tokens"] == 48
        assert max(events[r["id"]]) <= 4
    # every verify step is a decode step: decode tokens are each decode step's one token plus the
    # drafts it verified (a request's events after its first are its decode steps), and prefill
    # tokens are the prompts' tokens computed, nothing more
    assert sum(s.attributes[sc.STEP_DECODE_TOKENS] for s in steps) == sum(len(e) - 1 for e in events.values()) + drafted
    prefill = sum(s.attributes[sc.STEP_PREFILL_TOKENS] for s in steps)
    assert prefill == sum(r["prompt_tokens"] - r["cached_tokens"] for r in reqs)

    # each request's account (llm.engine.speculation, named by its internal id): its verify steps
    # are vLLM's own per-request arrays, exactly, and its entries line up with the request's token
    # events one for one
    accounts = {s.attributes[sc.REQUEST_INTERNAL_ID]: s for s in spans if s.name == sc.SPAN_ENGINE_SPECULATION}
    internal = {rid: root.attributes[sc.REQUEST_INTERNAL_ID] for rid, root in roots.items()}
    assert set(accounts) == set(internal.values())
    for r in reqs:
        a = accounts[internal[r["id"]]].attributes
        drafts = list(a[sc.SPECULATION_EVENT_DRAFTS])
        verify = [i for i, d in enumerate(drafts) if d >= 0]
        assert [drafts[i] for i in verify] == r["drafted"]
        assert [a[sc.SPECULATION_EVENT_ACCEPTED][i] for i in verify] == r["accepted"]
        assert list(a[sc.SPECULATION_EVENT_TOKENS]) == list(events[r["id"]])
        assert drafts[0] == -1  # the first token comes from the prefill: nothing verified
        assert a[sc.SPECULATION_DRAFT_TOKENS] == sum(r["drafted"]) and a[sc.SPECULATION_VERIFY_STEPS] == len(verify)
        assert a[sc.SPECULATION_ACCEPTED_TOKENS] == sum(r["accepted"])
        assert a[sc.SPECULATION_METHOD] == ("ngram" if method == "ngram" else "draft_model")
        assert a[sc.SPECULATION_K] == 3 and sc.SPECULATION_INCOMPLETE not in a
        # a verify step gives its request the accepted drafts and one token more (a stop may cut it)
        assert all(a[sc.SPECULATION_EVENT_TOKENS][i] <= a[sc.SPECULATION_EVENT_ACCEPTED][i] + 1 for i in verify)

    # the collector joins each account to its engine record: offline from the traces file, and a
    # collector fed the engine's own export requests, whose Prometheus counters are vLLM's
    path = str(tmp_path / f"spec-{method}.jsonl")
    check_records(derive_trace_file(path)[0], reqs)
    c = make_collector()
    for _, req in read_trace_requests(path):
        c.accept(req.SerializeToString())
    deadline = time.monotonic() + 20
    while c.records_derived < len(reqs) and time.monotonic() < deadline:
        time.sleep(0.05)
    c.store_writer.drain()
    check_records(c.store.batch(), reqs)
    assert c.self_counters()["speculation_accounts_joined"] == len(reqs)
    text = render(c.registry.snapshot())
    label = f'method="{"ngram" if method == "ngram" else "draft_model"}"'
    series = {
        ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if label in ln and "_total" in ln
    }
    assert series["llm_spec_decode_draft_tokens_total"] == drafted
    assert series["llm_spec_decode_accepted_tokens_total"] == accepted
    assert 'llm_spec_decode_acceptance_rate_count{boundary="engine"' in text


def cancel_while_drafting(base_url: str, model: str, c) -> list:
    """Three streams of a prompt that repeats itself (n-gram drafts from its first decode step),
    each given up after its first few chunks, while the engine drafts for it; returns them."""
    import asyncio

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from support.otlp_helpers import http_exporter

    from otel_llm.client.traced import TracedClient

    tp = TracerProvider(resource=Resource({"service.name": "spec-canceller"}))
    tp.add_span_processor(SimpleSpanProcessor(http_exporter(c.receivers[1].address[1])))
    prompt = [7, 9, 11, 13] * 8

    async def go() -> list:
        gone = []
        async with TracedClient(base_url, model=model, tracer_provider=tp) as cl:
            for delay in (0.15, 0.3, 0.45):
                task = asyncio.ensure_future(cl.completion(prompt, 400, extra={"ignore_eos": True}))
                await asyncio.sleep(delay)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                gone.append(delay)
                await asyncio.sleep(0.5)  # the server notices and aborts it
        return gone

    try:
        return asyncio.run(go())
    finally:
        tp.shutdown()


def check_records(batch, reqs) -> None:
    """Each engine record carries its request's speculation, equal to vLLM's own account."""
    engine = batch.at_boundary("engine")
    rows = {rid: i for i, rid in enumerate(engine.request_id)}
    assert set(rows) == {r["id"] for r in reqs}
    for r in reqs:
        i = rows[r["id"]]
        d, a, v = sum(r["drafted"]), sum(r["accepted"]), len(r["drafted"])
        assert (engine.draft_tokens[i], engine.accepted_tokens[i], engine.verify_steps[i]) == (d, a, v)
        assert engine.acceptance_rate[i] == pytest.approx(a / d)
        assert engine.mean_acceptance_length[i] == pytest.approx(1 + a / v)


def test_bench_against_a_speculative_vllm_server(make_collector, tiny_model):
    """``otel-llm bench`` against vLLM's OpenAI server with n-gram speculation and its own
    per-request account on (``--per-request-spec-decode-metrics detailed``): each request's client
    record carries the account vLLM's response gave (zero code on the engine), its engine record
    the hooks' own; they agree, request by request, and their sums are vLLM's counters. Streams
    given up while the engine drafts for them are one cancelled request at each boundary, their
    accounts joined, and what they drafted is in vLLM's counters and in ours alike."""
    c = make_collector(assembly=AssemblyConfig(grace_s=0.5, timeout_s=30))
    otlp = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{c.receivers[1].address[1]}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_LLM_SCHEDULE_DELAY": "100",
    }
    extra = ["--speculative-config", json.dumps(NGRAM), "--per-request-spec-decode-metrics", "detailed"]
    extra += ["--override-generation-config", json.dumps({"temperature": 0})]  # greedy: drafts that hold
    server, base_url = start_vllm_server(tiny_model, {"OTEL_LLM_ENABLE": "1", **otlp}, extra_args=extra)
    try:
        out = run_cli(
            "bench",
            *("--base-url", base_url, "--model", tiny_model, "--input-tokens", "32", "--output-tokens", "48"),
            *("--concurrency", "4", "--num-requests", "12", "--seed", "3", "--format", "json"),
            env={**otlp, "OTEL_TRACES_EXPORTER": "otlp"},
        )
        assert json.loads(out.stdout)["conditions"]["statuses"]["ok"] == 12
        cancelled = cancel_while_drafting(base_url, tiny_model, c)
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=10) as resp:
            exposition = resp.read().decode()
    finally:
        stop_cpu_server(server)
    vllm_counts = {
        name: sum(float(ln.rsplit(" ", 1)[1]) for ln in exposition.splitlines() if ln.startswith(name + "{"))
        for name in ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total")
    }
    deadline = time.monotonic() + 30
    while c.records_derived < 3 * (12 + len(cancelled)) and time.monotonic() < deadline:
        time.sleep(0.1)
    c.store_writer.drain()
    batch = c.store.batch()
    # the streams given up while the engine drafted: each one request at each boundary, cancelled,
    # its engine's account joined (what it drafted before the abort counts in vLLM's counters too)
    gone = [i for i, svc in enumerate(batch.service) if svc == "spec-canceller"]
    assert len(gone) == len(cancelled) and all(batch.status[i] == "cancelled" for i in gone)
    gone_engine = [i for i, p in enumerate(batch.peer_request_id) if p in {batch.request_id[g] for g in gone}]
    assert len(gone_engine) == len(cancelled) and all(batch.draft_tokens[i] >= 0 for i in gone_engine)
    assert all(batch.status[i] == "cancelled" for i in gone_engine), [batch.status[i] for i in gone_engine]
    drafted_by_cancelled = sum(int(batch.draft_tokens[i]) for i in gone_engine)
    all_engine = batch.at_boundary("engine")
    batch = batch.take([i for i in range(len(batch)) if i not in set(gone) | set(gone_engine)])
    client, engine = batch.at_boundary("client"), batch.at_boundary("engine")
    assert (len(client) == len(engine) == 12 and batch.pairs is not None) or client.paired.all()
    by_id = {rid: i for i, rid in enumerate(engine.request_id)}
    for i in range(len(client)):
        e = by_id[client.peer_request_id[i]]
        ours = (engine.draft_tokens[e], engine.accepted_tokens[e], engine.verify_steps[e])
        theirs = (client.draft_tokens[i], client.accepted_tokens[i], client.verify_steps[i])
        assert ours == theirs and theirs[0] >= 0, (client.request_id[i], ours, theirs)
        assert engine.spec_method[e] == "ngram" and client.spec_method[i] is None  # the client is not told
    # the run's sums are vLLM's counters, the cancelled requests' drafts included
    assert drafted_by_cancelled > 0
    assert int(all_engine.draft_tokens.sum()) == vllm_counts["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert int(all_engine.accepted_tokens.sum()) == vllm_counts["vllm:spec_decode_num_accepted_tokens_total"]
    # compare: each request's acceptance, and ITL per token event and per token side by side
    c.store_writer.drain()
    cmp = json.loads(run_cli("compare", "--store", c.config.store, "--format", "json").stdout)
    every = cmp["requests"]  # the cancelled streams are paired requests too
    assert len(every) == 12 + len(cancelled) and all(r["draft_tokens"] is not None for r in every)
    rows = [r for r in every if r["status"] == "ok"]  # the summary's distributions are of ok requests
    assert len(rows) == 12
    rates = [r["accepted_tokens"] / r["draft_tokens"] for r in rows if r["draft_tokens"]]
    d = cmp["summary"]["distributions"]
    assert d["acceptance_rate"]["n"] == len(rates) and d["acceptance_rate"]["max"] == pytest.approx(max(rates))
    # several tokens per event: a gap per token is shorter than the gap per event somewhere
    assert d["client_itl_per_token"]["n"] == d["client_itl"]["n"]
    assert d["client_itl_per_token"]["mean"] < d["client_itl"]["mean"]
    # the step that ended each request's largest gap: known on every row, within n-gram's k drafts
    k = NGRAM["num_speculative_tokens"]
    assert all(0 <= r["gap_step_accepted_tokens"] <= r["gap_step_draft_tokens"] <= k for r in rows), rows
    text = run_cli("compare", "--store", c.config.store).stdout
    assert "Speculative decoding, per request" in text and "client_itl_per_token" in text
    assert "largest stall: " in text
