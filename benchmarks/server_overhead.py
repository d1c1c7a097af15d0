"""Benchmark: what tracing costs vLLM's OpenAI server, side by side in one run.

Three servers on the tiny random-weight model (CPU): plain; traced by otel-llm
(``OTEL_LLM_ENABLE=1``: request and phase spans at ``--detail``, default phases, and the HTTP server
span), exporting over OTLP/gRPC to a local sink that discards, or with ``--exporter file`` to
``OTEL_LLM_TRACES_FILE``; and vLLM's own tracing (``--otlp-traces-endpoint`` to the same sink;
``--no-vllm-tracing`` leaves it out). The same ``otel-llm bench`` closed-loop load (``--concurrency``
64, ``--output-tokens`` 256) runs against each in rotating rounds, one server up at a time (two vLLM
CPU servers side by side bind their OpenMP threads to the same cores and disturb each other far
more than tracing does: an earlier version of this benchmark read traced/plain 1.04-1.57), so
drift hits all alike. Prints output tokens/s per round and server, and the median ratios to plain
of throughput and of CPU per output token (the CPU time, user + system, of the server's whole
process tree during the load, front end, API server and engine core, over the output tokens bench
counted in its window: the same load for each server; plain / traced, 1 = free),
and the HTTP server span's own cost per request and per body chunk in microseconds (its
middleware timed around a do-nothing ASGI app that streams 256 chunks).

Run: ``.venv/bin/python benchmarks/server_overhead.py [--rounds 5] [--requests 128] [--detail LEVEL]
[--exporter otlp|file]``
Target (docs/architecture.md, "The hot path"): traced/plain >= 0.99, and no worse than vLLM's own
tracing.
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

from overhead import Sink, tree_cpu_s  # noqa: E402


def start_server(model: str, env: dict, log_dir: str, name: str, args=()) -> tuple[subprocess.Popen, str]:
    from engine_hooks.tiny_model import start_cpu_server

    quiet = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    return start_cpu_server(model, {**quiet, **env}, os.path.join(log_dir, f"{name}.log"), extra_args=args)


def bench(base_url: str, model: str, requests: int, concurrency: int, tokens: int, with_tokens: bool = False):
    """Output tokens per second of one closed-loop run (and the tokens, ``with_tokens``)."""
    cmd = [sys.executable, "-m", "otel_llm", "bench", "--base-url", base_url, "--model", model]
    cmd += ["--concurrency", str(concurrency), "--num-requests", str(requests), "--input-tokens", "32"]
    cmd += ["--output-tokens", str(tokens), "--warmup", "4", "--format", "json"]
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none"}  # the client is the same for both: untraced
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True).stdout
    t = json.loads(out)["throughput"]
    tps = float(t["output_tokens_per_s"])
    return (tps, int(t["output_tokens"])) if with_tokens else tps


def middleware_cost_us(requests: int = 2000, chunks: int = 256) -> tuple[float, float]:
    """(us per request, us per chunk) the HTTP server span adds around a do-nothing streaming app."""
    from engine_hooks.asgi import TracingMiddleware
    from engine_hooks.hot_path.recorder import Recorder

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
    ap.add_argument("--detail", choices=("request", "phases", "steps"), default="phases")
    ap.add_argument("--exporter", choices=("otlp", "file"), default="otlp", help="the traced server's exporter")
    ap.add_argument("--no-vllm-tracing", action="store_true", help="leave out the server with vLLM's own tracing")
    a = ap.parse_args()
    from engine_hooks.tiny_model import build_tiny_model

    tmp = tempfile.mkdtemp(prefix="otel-llm-server-overhead-")
    model = a.model or build_tiny_model(os.path.join(tmp, "tiny-llama"))
    sink = Sink()
    sink_port = sink.port
    sink_url = f"http://127.0.0.1:{sink_port}"
    traced_env = {
        "OTEL_LLM_ENABLE": "1",
        "OTEL_LLM_DETAIL": a.detail,
        "OTEL_EXPORTER_OTLP_ENDPOINT": sink_url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }
    if a.exporter == "file":
        traced_env["OTEL_LLM_TRACES_FILE"] = os.path.join(tmp, "spans.jsonl")
    servers = [("plain", {}, ()), ("traced", traced_env, ())]
    if not a.no_vllm_tracing:
        servers.append(("vllm-tracing", {}, ("--otlp-traces-endpoint", sink_url)))
    print(
        f"otel-llm at detail {a.detail} with the {a.exporter} exporter; each round starts each server in turn "
        "(about 30 s a start)...",
        flush=True,
    )
    tput: dict[str, list[float]] = {name: [] for name, _, _ in servers}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in servers}  # CPU us per output token
    for r in range(a.rounds):
        order = servers[r % len(servers) :] + servers[: r % len(servers)]  # rotate who goes first
        for name, env, args in order:
            proc, url = start_server(model, env, tmp, f"{name}-{r}", args)
            try:
                bench(url, model, 16, 16, 16)  # warm-up: compile, caches
                c0 = tree_cpu_s(proc.pid)
                tps, tokens = bench(url, model, a.requests, a.concurrency, a.tokens, with_tokens=True)
                cpu[name].append((tree_cpu_s(proc.pid) - c0) / tokens * 1e6)
                tput[name].append(tps)
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        print(
            f"round {r + 1}: "
            + ", ".join(f"{k} {v[-1]:,.0f} output tokens/s ({cpu[k][-1]:.1f} us CPU/token)" for k, v in tput.items()),
            flush=True,
        )
    per_req, per_chunk = middleware_cost_us()
    for name in tput:
        if name == "plain":
            continue
        ratios = [t / p for t, p in zip(tput[name], tput["plain"])]
        cratios = [p / t for t, p in zip(cpu[name], cpu["plain"])]
        print(
            f"{name} / plain: throughput median {statistics.median(ratios):.3f} "
            f"(rounds {', '.join(f'{x:.3f}' for x in ratios)}); CPU per output token, plain / {name}: median "
            f"{statistics.median(cratios):.3f} (rounds {', '.join(f'{x:.3f}' for x in cratios)})"
        )
    print(
        f"{sink.report()[0]:,} spans reached the sink"
        + (" (otel-llm's went to the file)" if a.exporter == "file" else "")
    )
    print(f"HTTP server span: {per_req:.1f} us per request with 256 body chunks ({per_chunk:.2f} us per chunk)")
    sink.proc.terminate()


if __name__ == "__main__":
    main()
