"""Benchmark: what tracing costs vLLM's OpenAI server, side by side in one run.

Two servers on the tiny random-weight model (CPU): plain, and with ``OTEL_LLM_ENABLE=1`` (request,
phase and step spans, and the HTTP server span at its default detail), exporting over OTLP/gRPC to a
local sink that discards. The same ``otel-llm bench`` closed-loop load (``--concurrency`` 64,
``--output-tokens`` 256) runs against each in alternating rounds, one server up at a time (two vLLM
CPU servers side by side bind their OpenMP threads to the same cores and disturb each other far
more than tracing does: an earlier version of this benchmark read traced/plain 1.04-1.57), so
drift hits both alike. Prints output tokens/s per round and server, the median
traced/plain ratio, and the HTTP server span's own cost per request and per body chunk in
microseconds (its middleware timed around a do-nothing ASGI app that streams 256 chunks).

Run: ``.venv/bin/python benchmarks/server_overhead.py [--rounds 5] [--requests 128]``
Target (the three-boundary issue): traced/plain >= 0.98 here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from overhead import start_sink  # noqa: E402


def start_server(model: str, env: dict, log_dir: str, name: str) -> tuple[subprocess.Popen, str]:
    from engine_hooks.tiny_model import start_cpu_server

    quiet = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    return start_cpu_server(model, {**quiet, **env}, os.path.join(log_dir, f"{name}.log"))


def bench(base_url: str, model: str, requests: int, concurrency: int, tokens: int) -> float:
    cmd = [sys.executable, "-m", "otel_llm", "bench", "--base-url", base_url, "--model", model]
    cmd += ["--concurrency", str(concurrency), "--num-requests", str(requests), "--input-tokens", "32"]
    cmd += ["--output-tokens", str(tokens), "--warmup", "4", "--format", "json"]
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none"}  # the client is the same for both: untraced
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True).stdout
    return float(json.loads(out)["throughput"]["output_tokens_per_s"])


def middleware_cost_us(requests: int = 2000, chunks: int = 256) -> tuple[float, float]:
    """(us per request, us per chunk) the HTTP server span adds around a do-nothing streaming app."""
    from engine_hooks.asgi import TracingMiddleware
    from engine_hooks.recorder import Recorder

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(chunks):
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def send(m):
        pass

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    def scope():
        return {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"host", b"x")]}

    async def run(handler, n):
        t0 = time.perf_counter()
        for _ in range(n):
            await handler(scope(), receive, send)
        return time.perf_counter() - t0

    rec = Recorder(1 << 30)
    traced = TracingMiddleware(app, recorder=rec)
    plain_s = asyncio.run(run(app, requests))
    traced_s = asyncio.run(run(traced, requests))
    per_req = (traced_s - plain_s) / requests * 1e6
    return per_req, per_req / chunks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--model", default=None, help="model folder (default: build the tiny model in a temp dir)")
    a = ap.parse_args()
    from engine_hooks.tiny_model import build_tiny_model

    tmp = tempfile.mkdtemp(prefix="otel-llm-server-overhead-")
    model = a.model or build_tiny_model(os.path.join(tmp, "tiny-llama"))
    sink, sink_port, received = start_sink()
    traced_env = {
        "OTEL_LLM_ENABLE": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    }
    print("each round starts each server in turn (about 30 s a start)...", flush=True)
    ratios = []
    for r in range(a.rounds):
        order = [("plain", {}), ("traced", traced_env)]
        if r % 2:
            order.reverse()
        tps = {}
        for name, env in order:
            proc, url = start_server(model, env, tmp, f"{name}-{r}")
            try:
                bench(url, model, 16, 16, 16)  # warm-up: compile, caches
                tps[name] = bench(url, model, a.requests, a.concurrency, a.tokens)
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        ratios.append(tps["traced"] / tps["plain"])
        print(
            f"round {r + 1}: plain {tps['plain']:,.0f} output tokens/s, traced {tps['traced']:,.0f}; "
            f"traced/plain {ratios[-1]:.3f}",
            flush=True,
        )
    per_req, per_chunk = middleware_cost_us()
    print(
        f"median traced/plain {statistics.median(ratios):.3f} over {len(ratios)} rounds "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}; target >= 0.98); {received[0]:,} spans reached the sink"
    )
    print(f"HTTP server span: {per_req:.1f} us per request with 256 body chunks ({per_chunk:.2f} us per chunk)")
    sink.stop(0)


if __name__ == "__main__":
    main()
