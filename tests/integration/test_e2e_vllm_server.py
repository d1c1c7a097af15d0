"""The whole loop on a real vLLM OpenAI server (CPU, tiny model): engine traced through the
plugin (OTEL_LLM_ENABLE=1), otel-llm bench open and closed loop, the collector joining both
boundaries, and otel-llm compare."""

import json
import time

import pytest
from conftest import run_cli, start_vllm_server
from support.hung_endpoint import span_processes

from collector.pipeline.assembly import AssemblyConfig
from engine_hooks.tiny_model import stop_cpu_server

pytestmark = pytest.mark.slow


def test_bench_against_traced_vllm_server(make_collector, tiny_model, tmp_path):
    c = make_collector(assembly=AssemblyConfig(grace_s=0.5, timeout_s=30))
    otlp = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{c.receivers[1].address[1]}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # the client's BatchSpanProcessor
        "OTEL_LLM_SCHEDULE_DELAY": "100",  # the engine hooks' span builder
    }
    server, base_url = start_vllm_server(tiny_model, {"OTEL_LLM_ENABLE": "1", **otlp})
    try:
        # the front end's span process started with the engine, before any request: the first
        # request's spans are not a span process's start-up late (its client exports every 100 ms)
        t0 = time.monotonic()
        while not span_processes(server.pid) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert span_processes(server.pid), "no span process before the first request"
        common = [
            "--base-url",
            base_url,
            "--model",
            tiny_model,
            "--input-tokens",
            "32",
            "--output-tokens",
            "24",
            "--format",
            "json",
            "--warmup",
            "2",
        ]
        open_run = json.loads(
            run_cli(
                "bench",
                *common,
                "--rate",
                "15",
                "--num-requests",
                "24",
                "--seed",
                "1",
                env={**otlp, "OTEL_TRACES_EXPORTER": "otlp"},
            ).stdout
        )
        closed_run = json.loads(
            run_cli(
                "bench",
                *common,
                "--concurrency",
                "4",
                "--num-requests",
                "16",
                "--seed",
                "2",
                env={**otlp, "OTEL_TRACES_EXPORTER": "otlp"},
            ).stdout
        )
    finally:
        stop_cpu_server(server)
    assert open_run["conditions"]["statuses"]["ok"] == 24 and closed_run["conditions"]["statuses"]["ok"] == 16
    assert open_run["conditions"]["load_mode"] == "open" and closed_run["conditions"]["load_mode"] == "closed"
    n = 3 * (24 + 16 + 4)  # the three boundaries of every request (client, HTTP server, engine), warm-ups included
    t0 = time.monotonic()
    while c.store.count() < n and time.monotonic() - t0 < 60:
        time.sleep(0.2)
    records = c.store.records()
    clients = {r.trace_id: r for r in records if r.boundary == "client"}
    engines = {r.trace_id: r for r in records if r.boundary == "engine"}
    servers = {r.trace_id: r for r in records if r.boundary == "server"}
    assert len(clients) == 44 and set(engines) == set(clients) == set(servers)  # every boundary, one trace
    for tid, cl in clients.items():
        en = engines[tid]
        assert cl.paired and en.paired and cl.status == en.status == "ok"
        # the eight parts, with the HTTP server span the plugin adds inside vLLM's API server and
        # the moment our client began writing the request
        eight = (cl.client_send, cl.network_in, cl.api_in, cl.front_end, cl.queue, cl.prefill, cl.api_out)
        eight += (cl.network_out,)
        assert None not in eight, eight
        assert abs(sum(eight) - cl.ttft) < 1e-6  # one host: the parts sum to the client TTFT
        assert cl.network_in > 0 and cl.client_send >= 0  # the server read what the client had begun to write
        assert (
            abs(cl.client_send + cl.network_in + cl.api_in - cl.to_engine) < 1e-9
            and abs(cl.api_out + cl.network_out - cl.delivery) < 1e-9
        )
        assert en.ttft <= cl.ttft
        # the server boundary sits between the two: it got the request before the engine and wrote
        # each token after the engine handed it out, and before the client had it (one host); its
        # span ends when the app returned, which may be after the client closed on [DONE]
        sv = servers[tid]
        assert cl.submit_ns <= sv.submit_ns <= en.submit_ns and en.end_ns <= sv.end_ns
        assert all(s <= c for s, c in zip(sv.event_times, cl.event_times))
        assert en.ttft <= sv.ttft <= cl.ttft and sv.output_tokens == 24
        assert sv.submit_ns + sv.event_offsets_ns[0] == cl.server_first_chunk_ns
        assert cl.output_tokens == en.output_tokens == 24
        assert min(eight) > -1e-3 and cl.api_in > 0 and cl.front_end > 0  # vLLM says when it queued the request
    out = json.loads(run_cli("compare", "--store", c.config.store, "--format", "json").stdout)
    assert out["summary"]["requests_paired"] == 40  # the 4 warm-ups are left out, as everywhere
    with_warmup = run_cli("compare", "--store", c.config.store, "--include-warmup", "--format", "json").stdout
    assert json.loads(with_warmup)["summary"]["requests_paired"] == 44
    assert out["summary"]["clock_offset"]["theta_s"] == 0  # one host, one clock: the bounds contain 0
    assert out["summary"]["max_abs_parts_sum_error_s"] < 1e-3
    assert {"client_send", "network_in", "api_in", "front_end", "queue", "prefill", "api_out", "network_out"} <= set(
        out["summary"]["ttft_share"]
    )
    # the engine core's step spans reached the collector too (counted, not derived per request)
    assert c.receiver_counters.spans > 44 * 7
    # runs told apart, warm-ups left out: what analyze reads back is what bench reported
    store = c.config.store
    for run, n in ((open_run, 24), (closed_run, 16)):
        back = json.loads(
            run_cli("analyze", "--store", store, "--run", run["conditions"]["run_id"], "--format", "json").stdout
        )
        assert back["counts"]["requests"] == n == run["counts"]["requests"]
        for p in ("p50", "p99"):
            assert back["latency"]["ttft"][p] == pytest.approx(run["latency"]["ttft"][p], abs=1e-6)
    assert open_run["conditions"]["run_id"] != closed_run["conditions"]["run_id"]
    at_server = json.loads(run_cli("analyze", "--store", store, "--boundary", "server", "--format", "json").stdout)
    assert at_server["counts"]["requests"] == 40  # the warm-ups left out here too
    every = json.loads(run_cli("analyze", "--store", store, "--format", "json").stdout)
    assert every["counts"]["requests"] == 40  # both runs, without their 2 + 2 warm-ups
    with_warmup = json.loads(run_cli("analyze", "--store", store, "--include-warmup", "--format", "json").stdout)
    assert with_warmup["counts"]["requests"] == 44
