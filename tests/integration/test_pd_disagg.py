"""Disaggregated prefill and decode on real vLLM servers (#43): a prefill and a decode server on the
tiny model, NIXL moving the KV cache over TCP, the reference proxy (examples/pd_proxy.py, traced
with engine_hooks.trace_proxy) in front, otel-llm bench as the client, a real collector. Each
client request is one request in the collector: its client record, one engine record (the decode
leg, its prefill leg joined, never a record of its own), the tokens the client received."""

from __future__ import annotations

import json
import time

import pytest
from conftest import run_cli
from support.pd_servers import start_pd

from collector.pipeline.assembly import AssemblyConfig

pytestmark = pytest.mark.slow

N = 8


def test_each_request_is_one_record_with_both_legs(make_collector, tiny_model, tmp_path):
    c = make_collector(assembly=AssemblyConfig(grace_s=0.5, peer_wait_s=5, timeout_s=30))
    otlp = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{c.receivers[1].address[1]}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_LLM_SCHEDULE_DELAY": "100",
    }
    pd = start_pd(tiny_model, {"OTEL_LLM_ENABLE": "1", **otlp}, str(tmp_path))
    try:
        run = json.loads(
            run_cli(
                "bench", "--base-url", pd.proxy_url, "--model", tiny_model, "--input-tokens", "48",
                "--output-tokens", "12", "--concurrency", "2", "--num-requests", str(N), "--seed", "3",
                "--format", "json", env={**otlp, "OTEL_TRACES_EXPORTER": "otlp"},
            ).stdout
        )  # fmt: skip
    finally:
        pd.stop()
    assert run["conditions"]["statuses"]["ok"] == N
    t0 = time.monotonic()
    while c.store.count() < 3 * N and time.monotonic() - t0 < 60:
        time.sleep(0.2)
    time.sleep(2)  # anything more (a prefill leg on its own) would have come by now
    records = c.store.records()
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
        parts = (cl.to_engine, cl.front_end, cl.queue, cl.prefill, cl.api_out, cl.network_out)
        assert None not in parts and abs(sum(parts) - cl.ttft) < 1e-6
        assert cl.to_engine > en.prefill_leg
    out = json.loads(run_cli("compare", "--store", c.config.store, "--format", "json").stdout)
    assert out["summary"]["requests_paired"] == N
