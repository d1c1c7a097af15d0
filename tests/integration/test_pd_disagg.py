"""Disaggregated prefill and decode on real vLLM servers (#43): a prefill and a decode server on the
tiny model, NIXL moving the KV cache over TCP, the reference proxy (examples/pd_proxy.py, traced
with engine_hooks.trace_proxy) in front, a real collector. Each client request is one request in
the collector: one engine record (the decode leg, its prefill leg joined, never a record of its
own) with the tokens the client received, whoever the client is: otel-llm bench (its client span
paired) or vLLM's own benchmark client (its saved results joined by the request id it sent)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from conftest import run_cli, start_collector
from support.pd_servers import start_pd
from support.third_party_clients import vllm_bench_serve

from engine_hooks.tiny_model import SPEC as TINY

pytestmark = pytest.mark.slow

N = 8
#: the tiny model's KV block in bytes, as vLLM lays it out on CPU: 128 tokens a block, K and V, per
#: layer, per KV head, head_dim bfloat16 values (engine_hooks/tiny_model.py's SPEC)
BLOCK_BYTES = 128 * 2 * TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * 2
BLOCK_BYTES *= TINY["hidden_size"] // TINY["num_attention_heads"]


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    """One collector, and a traced prefill server, decode server and proxy sending to it."""
    tmp = tmp_path_factory.mktemp("pd")
    c, otlp = start_collector(str(tmp / "store.db"), grace_s=0.5)
    otlp = {**otlp, "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_LLM_SCHEDULE_DELAY": "100"}
    try:
        deployment = start_pd(tiny_model, {**otlp, "OTEL_LLM_ENABLE": "1"}, str(tmp))
    except BaseException:
        c.stop()
        raise
    try:
        yield c, otlp, deployment
    finally:
        deployment.stop()
        c.stop()


def _stored(c, at_least: int) -> list:
    deadline = time.monotonic() + 60
    while c.store.count() < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)  # anything more (a prefill leg on its own) would have come by now
    return c.store.records()


def test_each_request_is_one_record_with_both_legs(pd, tiny_model):
    c, otlp, deployment = pd
    before = c.store.count()
    run = json.loads(
        run_cli(
            "bench", "--base-url", deployment.proxy_url, "--model", tiny_model, "--input-tokens", "48",
            "--output-tokens", "12", "--concurrency", "2", "--num-requests", str(N), "--seed", "3",
            "--run-id", "pd-bench", "--format", "json", env=otlp,
        ).stdout
    )  # fmt: skip
    assert run["conditions"]["statuses"]["ok"] == N
    records = [r for r in _stored(c, before + 3 * N) if r.run_id == "pd-bench"]
    clients = {r.trace_id: r for r in records if r.boundary == "client"}
    engines = [r for r in records if r.boundary == "engine"]
    assert len(clients) == N
    assert len(engines) == N, sorted((r.pd_role, r.internal_id) for r in engines)  # not 2N: one per request
    for en in engines:
        cl = clients[en.trace_id]
        assert en.pd_role == cl.pd_role == "disaggregated"
        assert en.pd_connector == "NixlConnector" and en.prefill_engine_id and en.prefill_request_id
        assert cl.paired and en.paired and cl.status == en.status == "ok"
        assert cl.output_tokens == en.output_tokens == 12  # the decode leg's: what the client received
        assert en.prefill_leg_tokens == 1  # the prefill leg's one token, which the proxy discarded
        assert 0 < en.prefill_leg_prefill <= en.prefill_leg < cl.ttft
        # the prefill leg ended before the decode leg began, on this one host's clock
        assert en.submit_ns - cl.submit_ns > en.prefill_leg * 1e9
        assert en.ttft <= cl.ttft
        # the client's TTFT still adds up; what went before the decode server is not called network
        assert cl.network_in is None
        # the decode engine's queue without its KV fetch: the transfer and the step that took it up
        assert en.kv_transfer > 0 and en.kv_ready >= 0 and en.queue >= 0 and en.kv_blocks > 0
        assert (cl.queue, cl.kv_transfer, cl.kv_ready, cl.kv_blocks) == (
            en.queue,
            en.kv_transfer,
            en.kv_ready,
            en.kv_blocks,
        )
        parts = (cl.to_engine, cl.front_end, cl.queue, cl.kv_transfer, cl.kv_ready, cl.prefill, cl.api_out)
        parts += (cl.network_out,)
        assert None not in parts and abs(sum(parts) - cl.ttft) < 1e-6
        assert cl.to_engine > en.prefill_leg
        # to_engine at the prefill engine: the way there (the proxy in it), its leg, the hop to decode
        assert cl.to_prefill > 0 and cl.pd_hop > 0 and cl.prefill_leg == en.prefill_leg
        assert abs(cl.to_prefill + cl.prefill_leg + cl.pd_hop - cl.to_engine) < 1e-6
        assert en.prefill_arrival_ns > cl.submit_ns
        # the prefill engine held the blocks from its finish until the decode engine had read them:
        # past the decode engine's arrival (one host's clock)
        finish_ns = en.prefill_arrival_ns + en.prefill_leg * 1e9
        assert en.prefill_kv_hold > 0 and finish_ns + en.prefill_kv_hold * 1e9 > en.submit_ns
        assert cl.prefill_kv_hold == en.prefill_kv_hold
        # the bytes NIXL says it moved are the blocks the load asked for, whole
        assert en.kv_bytes == en.kv_blocks * BLOCK_BYTES and 0 < en.kv_wire < en.kv_transfer
        assert en.kv_handshake is None or 0 < en.kv_handshake < en.kv_transfer
    # the first requests from the prefill engine waited for the decode engine's handshake with it
    waited = [en.kv_handshake is not None for en in sorted(engines, key=lambda r: r.submit_ns)]
    assert waited[0] and not any(waited[2:]), waited
    out = json.loads(run_cli("compare", "--store", c.config.store, "--run", "pd-bench", "--format", "json").stdout)
    assert out["summary"]["requests_paired"] == N
    assert {r["pd_role"] for r in out["requests"]} == {"disaggregated"}
    assert all(r["prefill_leg"] > 0 and r["kv_transfer"] > 0 for r in out["requests"])
    fine = ("to_prefill", "prefill_leg", "pd_hop", "front_end", "queue", "kv_transfer", "kv_ready", "prefill")
    for r in out["requests"]:
        assert abs(sum(r[p] for p in (*fine, "api_out", "network_out")) - r["client_ttft"]) < 1e-6
    assert {"to_prefill", "prefill_leg", "pd_hop", "kv_transfer"} <= set(out["summary"]["ttft_share"])
    text = run_cli("compare", "--store", c.config.store, "--run", "pd-bench").stdout
    assert "kv_transfer" in text and "prefill_leg" in text  # what a user reads


def test_vllms_benchmark_client_through_the_proxy(pd, tiny_model, tmp_path):
    """vLLM's bench serve (no trace context of its own): the proxy's span is each trace's root; its
    saved results join the decode records by the request id it sent, which the proxy passed on."""
    c, _, deployment = pd
    before = c.store.count()
    result = vllm_bench_serve(
        deployment.proxy_url, tiny_model, tmp_path,
        *("--dataset-name", "random", "--random-input-len", "48", "--random-output-len", "16"),
        *("--ignore-eos", "--num-prompts", str(N), "--request-rate", "4", "--seed", "5"),
        *("--request-id-prefix", "PD"),
    )  # fmt: skip
    assert not any(result["errors"]), result["errors"]
    records = _stored(c, before + 2 * N)
    engines = {r.request_id: r for r in records if r.boundary == "engine" and r.request_id.startswith("cmpl-PD")}
    assert sorted(engines) == sorted(f"cmpl-PD{i}-0" for i in range(N))  # one record per request
    for i, tokens in enumerate(result["output_lens"]):
        en = engines[f"cmpl-PD{i}-0"]
        assert en.pd_role == "disaggregated" and en.output_tokens == tokens == 16 and en.prefill_leg_tokens == 1
        assert en.ttft <= result["ttfts"][i]
    (path,) = tmp_path.glob("vllm-bench-*.json")
    out = run_cli("compare", "--store", c.config.store, "--client-results", path, "--format", "json")
    assert f"{N} of {N} requests of vllm bench serve" in out.stderr
    rows = {r["id"]: r for r in json.loads(out.stdout)["requests"]}
    diffs = []
    for i, ttft in enumerate(result["ttfts"]):
        r = rows[f"PD{i}"]
        assert abs(r["client_ttft"] - ttft) < 1e-6  # the tool's own TTFT
        assert r["network_in"] is None  # the proxy and the prefill leg are not network
        parts = [r[p] for p in ("to_engine", "front_end", "queue", "kv_transfer", "kv_ready", "prefill", "api_out")]
        parts.append(r["network_out"])
        assert None not in parts and abs(sum(parts) - ttft) < 1e-6
        assert abs(r["to_prefill"] + r["prefill_leg"] + r["pd_hop"] - r["to_engine"]) < 1e-6  # the tool's too
        en = engines[f"cmpl-PD{i}-0"]
        diffs.append((ttft, en.ttft, en.prefill_leg, en.kv_transfer, en.kv_ready, en.queue))
    d = np.median(np.array(diffs) * 1e3, axis=0)
    print(f"vllm bench serve through the P/D proxy, {N} requests, p50 ms: client TTFT {d[0]:.1f}, decode engine TTFT ")
    print(f"{d[1]:.1f}, prefill leg {d[2]:.1f}, KV transfer {d[3]:.1f}, KV ready {d[4]:.1f}, decode queue {d[5]:.1f}")


def test_clients_that_give_up_while_the_kv_cache_moves(pd, tiny_model):
    """Clients that cancel at moments across their first token's way (the prefill leg, the hop, the
    KV transfer, the decode engine's first step): each is still one request at the engine, its legs
    joined (never a prefill leg left as a request of its own), cancelled at the client; a KV part is
    known and > 0 or unknown, never 0; and both servers serve the next request."""
    import asyncio

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from support.otlp_helpers import http_exporter

    from otel_llm.client.traced import TracedClient

    c, _, deployment = pd
    tp = TracerProvider(resource=Resource({"service.name": "pd-canceller"}))
    tp.add_span_processor(SimpleSpanProcessor(http_exporter(c.receivers[1].address[1])))
    delays = (0.02, 0.035, 0.05, 0.065, 0.08, 0.1, 0.15)
    prompt = list(range(100, 148))

    async def go():
        async with TracedClient(deployment.proxy_url, model=tiny_model, tracer_provider=tp) as cl:
            for d in delays:
                task = asyncio.ensure_future(cl.completion(prompt, 32, extra={"ignore_eos": True}))
                await asyncio.sleep(d)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await asyncio.sleep(0.3)  # the proxy and the decode engine notice, one at a time
            return await cl.completion(prompt, 4, extra={"ignore_eos": True})

    before = c.store.count()
    last = asyncio.run(go())
    tp.shutdown()
    assert last.output_tokens == 4  # served after all of it
    records = _stored(c, before + 3 * (len(delays) + 1))
    clients = {r.trace_id: r for r in records if r.boundary == "client" and r.service == "pd-canceller"}
    assert len(clients) == len(delays) + 1
    engines = [r for r in records if r.boundary == "engine" and r.trace_id in clients]
    assert len(engines) == len(delays) + 1, sorted((r.pd_role, r.status) for r in engines)
    seen = []
    for en in sorted(engines, key=lambda r: r.submit_ns):
        cl = clients[en.trace_id]
        assert cl.paired and en.pd_role in ("disaggregated", "prefill"), en.pd_role
        if en.pd_role == "prefill":  # given up before the proxy reached the decode server: the leg alone,
            assert en.status == cl.status == "cancelled"  # which served nobody: not a success
        else:
            assert en.prefill_request_id and en.prefill_leg > 0
        for part in (en.kv_transfer, en.kv_handshake, en.kv_wire):
            assert part is None or part > 0
        seen.append((cl.status, en.status, en.pd_role))
    assert seen[-1] == ("ok", "ok", "disaggregated") and all(x[0] == "cancelled" for x in seen[:-1]), seen
    print("P/D cancels (client, engine, role), by delay:", list(zip((*delays, "-"), seen)))


def test_a_kv_load_that_fails_is_said_and_fails_the_request(pd, tiny_model):
    """A decode request whose prefill engine is gone (its kv_transfer_params name a peer nobody
    listens for: NIXL's handshake times out, 5 s): vLLM's default kv_load_failure_policy (fail)
    fails it, and the record says kv_load failed, status error, with no KV transfer shown; the
    server serves the next request."""
    import asyncio

    import httpx
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from support.otlp_helpers import http_exporter

    from engine_hooks.tiny_model import free_port
    from otel_llm.client.traced import TracedClient

    c, _, deployment = pd
    tp = TracerProvider(resource=Resource({"service.name": "pd-lost-peer"}))
    tp.add_span_processor(SimpleSpanProcessor(http_exporter(c.receivers[1].address[1])))
    params = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "gone-engine",
        "remote_request_id": "cmpl-gone-0", "remote_block_ids": [[0]], "remote_host": "127.0.0.1",
        "remote_port": free_port(), "tp_size": 1,
    }  # fmt: skip

    async def go():
        async with TracedClient(deployment.decode_url, model=tiny_model, tracer_provider=tp) as cl:
            return await cl.completion(list(range(100, 148)), 4, extra={"kv_transfer_params": params})

    before = c.store.count()
    try:
        result = asyncio.run(go())
    except Exception as exc:  # an error answer may raise: what counts is the record
        result = exc
    tp.shutdown()
    records = _stored(c, before + 3)
    (cl,) = [r for r in records if r.boundary == "client" and r.service == "pd-lost-peer"]
    (en,) = [r for r in records if r.boundary == "engine" and r.trace_id == cl.trace_id]
    assert cl.status == "error", (cl.status, result)
    assert en.pd_role == "decode" and en.kv_load == "failed" and en.status == "error"
    assert en.kv_transfer is None and en.kv_bytes is None
    r = httpx.post(f"{deployment.decode_url}/completions", json={"model": tiny_model, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


def test_the_decode_server_down(pd, tiny_model):
    """The decode server gone: the client gets the proxy's error, and the request is recorded as
    failed at the client and at its prefill leg, which did not serve it (last: it stops the
    decode server)."""
    from engine_hooks.tiny_model import stop_cpu_server

    c, otlp, deployment = pd
    stop_cpu_server(deployment.decode)
    before = c.store.count()
    run = run_cli(
        "bench", "--base-url", deployment.proxy_url, "--model", tiny_model, "--input-tokens", "48",
        "--output-tokens", "12", "--concurrency", "1", "--num-requests", "2", "--seed", "4",
        "--run-id", "pd-down", "--format", "json", env=otlp, check=False,
    )  # fmt: skip
    assert json.loads(run.stdout)["conditions"]["statuses"].get("error") == 2, run.stdout[-2000:]
    records = [r for r in _stored(c, before + 6) if r.run_id == "pd-down"]
    clients = [r for r in records if r.boundary == "client"]
    engines = [r for r in records if r.boundary == "engine"]
    assert len(clients) == len(engines) == 2
    assert {r.status for r in clients} == {"error"}
    for en in engines:  # the prefill leg alone, paired with its client: not a success
        assert en.pd_role == "prefill" and en.status == "error" and en.paired
        assert en.prefill_leg is None


def test_the_disk_connector_whose_legs_name_no_peer(tiny_model, tmp_path):
    """vLLM's disk connector (ExampleConnector): the prefill engine saves the prompt's KV blocks in a
    shared directory and answers no kv_transfer_params, so the decode leg names no prefill leg (it
    says both) and loads what whole blocks it finds there, recomputing the rest. Still one request
    per client request, both legs joined by the proxy span above them, the parts summing to the
    client's TTFT; no KV fetch to split (the load runs inside the decode engine's prefill), so the
    KV parts and bytes are unknown, not 0."""
    c, otlp = start_collector(str(tmp_path / "store.db"), grace_s=0.5)
    otlp = {**otlp, "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_LLM_SCHEDULE_DELAY": "100"}
    kv_dir = tmp_path / "kv"
    try:
        deployment = start_pd(
            tiny_model, {**otlp, "OTEL_LLM_ENABLE": "1"}, str(tmp_path), connector="ExampleConnector",
            connector_config={"shared_storage_path": str(kv_dir)},
        )  # fmt: skip
    except BaseException:
        c.stop()
        raise
    try:
        for tokens in (48, 300):  # under one 128-token block: recomputed; two whole blocks and a tail
            run = run_cli(
                "bench", "--base-url", deployment.proxy_url, "--model", tiny_model, "--input-tokens", str(tokens),
                "--output-tokens", "8", "--concurrency", "1", "--num-requests", "3", "--seed", "6",
                "--run-id", f"disk-{tokens}", "--format", "json", env=otlp,
            )  # fmt: skip
            assert json.loads(run.stdout)["conditions"]["statuses"]["ok"] == 3
        records = _stored(c, 3 * 6)
    finally:
        deployment.stop()
        c.stop()
    engines = [r for r in records if r.boundary == "engine"]
    clients = {r.peer_request_id: r for r in records if r.boundary == "client"}
    assert len(engines) == 6, sorted((r.pd_role, r.internal_id) for r in engines)  # not 12: one per request
    for en in engines:
        cl = clients[en.request_id]
        assert en.pd_role == cl.pd_role == "disaggregated" and en.pd_connector == "ExampleConnector"
        assert en.prefill_request_id and en.prefill_leg_tokens == 1 and cl.output_tokens == en.output_tokens == 8
        assert en.kv_transfer is None and en.kv_bytes is None and en.kv_blocks is None
        parts = (cl.to_prefill, cl.prefill_leg, cl.pd_hop, cl.front_end, cl.queue, cl.prefill, cl.api_out)
        assert None not in parts and abs(sum(parts) + cl.network_out - cl.ttft) < 1e-6
    assert any(kv_dir.rglob("*.safetensors"))  # what the prefill engine saved for the decode engine
