"""Benchmark: the collector's peak memory when many large OTLP/JSON bodies arrive at once.

Parsing OTLP/JSON builds Python objects for every value: a 3.8 MiB body takes about 50 times its
size while it is parsed. ``--max-json-decodes`` (default 2) bounds how many are parsed at once; the
rest wait up to a second and then get 503 (the sender retries). This starts ``otel-llm collector``
(a fresh process each) with the default and with the bound lifted to the number of senders, sends
``--senders`` bodies of about 3.8 MiB at the same moment, and prints each run's peak RSS (VmHWM)
and the answers.

Run: ``.venv/bin/python benchmarks/json_memory.py [--senders 8]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path[:0] = [ROOT, HERE]

from collector_throughput import payloads  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

from engine_hooks.tiny_model import free_port  # noqa: E402
from otel_llm.otlp.otlp_json import to_json  # noqa: E402


def _json_body(n: int) -> bytes:
    """One OTLP/JSON export request of ``n`` requests (6 spans each: both boundaries and the phases)."""
    (body,), _ = payloads(n, spans_per_payload=6 * n)
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    return to_json(req).encode()


def body_of(mib: float) -> bytes:
    """An OTLP/JSON export request of about ``mib`` MiB (many requests at both boundaries)."""
    n = 100
    for _ in range(2):  # sized from a sample, then corrected once
        n = max(1, int(n * mib * 2**20 / len(_json_body(n))))
    return _json_body(n)


def vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def run(body: bytes, senders: int, max_json: int) -> tuple[int, int, list[int]]:
    port = free_port()
    cmd = [sys.executable, "-m", "otel_llm", "collector", "--otlp-grpc", "off", "--otlp-http", f"127.0.0.1:{port}"]
    cmd += ["--prometheus", "off", "--store", "off", "--max-json-decodes", str(max_json)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        proc.stdout.readline()
        time.sleep(0.5)
        before = vm_hwm(proc.pid)
        codes: list[int] = []
        go = threading.Barrier(senders)

        def send():
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/traces", data=body, headers={"Content-Type": "application/json"}
            )
            go.wait()
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    codes.append(r.status)
            except urllib.error.HTTPError as exc:
                codes.append(exc.code)

        threads = [threading.Thread(target=send) for _ in range(senders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return before, vm_hwm(proc.pid), sorted(codes)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--senders", type=int, default=8, help="bodies sent at once (default 8)")
    ap.add_argument("--mib", type=float, default=3.8, help="size of each body in MiB (default 3.8)")
    a = ap.parse_args()
    body = body_of(a.mib)
    print(f"{a.senders} senders at once, each an OTLP/JSON body of {len(body) / 2**20:.2f} MiB", flush=True)
    for max_json in (a.senders, 2):
        before, peak, codes = run(body, a.senders, max_json)
        label = "default" if max_json == 2 else "lifted to the senders"
        print(
            f"--max-json-decodes {max_json} ({label}): peak RSS {before / 2**20:,.0f} -> {peak / 2**20:,.0f} MiB; "
            f"answers {', '.join(f'{c} x{codes.count(c)}' for c in sorted(set(codes)))}",
            flush=True,
        )


if __name__ == "__main__":
    main()
