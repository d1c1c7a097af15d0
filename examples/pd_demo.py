"""The disaggregated prefill/decode demo (``make pd-demo``), on the tiny random-weight Llama built
here (nothing downloaded): the collector, a prefill and a decode vLLM server traced through the
plugin (``OTEL_LLM_ENABLE=1``) whose KV cache moves with NIXL over TCP, the reference proxy traced
with ``engine_hooks.trace_proxy`` (``examples/pd_proxy.py``), ``otel-llm bench`` through the proxy,
then ``otel-llm compare``: each request once, its prefill leg, its KV transfer and the decode
engine's queue without it. Everything it writes goes to ``out/pd-demo/``; about two minutes here.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

from pd_servers import start_pd

from engine_hooks.tiny_model import build_tiny_model, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "out", "pd-demo")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
CLI = os.path.relpath(os.path.join(os.path.dirname(sys.executable), "otel-llm"), ROOT)


def otel_llm(*args: str, env: dict) -> None:
    print(f"$ {CLI} " + shlex.join(args), flush=True)
    subprocess.run([sys.executable, "-m", "otel_llm", *args], check=True, env=env, cwd=ROOT)


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    model = build_tiny_model(os.path.join(OUT, "tiny-llama"))
    store = os.path.join(OUT, "store.db")
    for f in (store, store + "-wal", store + "-shm"):
        if os.path.exists(f):
            os.remove(f)
    grpc, http = free_port(), free_port()
    print("\n=== the collector", flush=True)
    collector = subprocess.Popen(
        [sys.executable, "-m", "otel_llm", "collector", "--otlp-grpc", f"127.0.0.1:{grpc}", "--otlp-http",
         f"127.0.0.1:{http}", "--prometheus", f"127.0.0.1:{free_port()}", "--store", store],
        env=ENV, cwd=ROOT,
    )  # fmt: skip
    otlp = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{http}", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    try:
        print("\n=== a prefill and a decode vLLM server (NixlConnector over TCP) and the traced proxy", flush=True)
        t0 = time.monotonic()
        pd = start_pd(model, {**otlp, "OTEL_LLM_ENABLE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}, OUT)
        up = time.monotonic() - t0
        print(f"up in {up:.0f} s: proxy {pd.proxy_url}, prefill {pd.prefill_url}, decode {pd.decode_url}")
        try:
            print("\n=== otel-llm bench through the proxy", flush=True)
            otel_llm(
                "bench", "--base-url", pd.proxy_url, "--model", model, "--input-tokens", "64", "--output-tokens",
                "16", "--concurrency", "2", "--num-requests", "12", "--run-id", "pd-demo",
                env={**ENV, **otlp, "OTEL_TRACES_EXPORTER": "otlp"},
            )  # fmt: skip
        finally:
            pd.stop()
        time.sleep(2)  # the collector's grace period for the last spans
    finally:
        collector.send_signal(signal.SIGTERM)
        collector.wait(60)
    print("\n=== otel-llm compare: each request once; its prefill leg, KV transfer and decode queue", flush=True)
    otel_llm("compare", "--store", store, "--run", "pd-demo", env=ENV)
    print(f"\nlogs and the store: {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
