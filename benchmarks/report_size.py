"""Benchmark: how big ``otel-llm report`` is and how long it takes at 10,000 requests.

Builds a store of ``--requests`` requests at both boundaries (the collector's own derivation of
realistic spans: 64 token events a boundary) and the engine steps of such a run (one step every
5 ms), then times ``otel-llm report`` on it and prints the file's size.

Run: ``.venv/bin/python benchmarks/report_size.py [--requests 10000]``
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]

import numpy as np  # noqa: E402
from collector_throughput import request_spans  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

from collector.config import CollectorConfig  # noqa: E402
from collector.pipeline.steps import StepBatch  # noqa: E402
from collector.service import Collector  # noqa: E402


def build_store(path: str, n: int) -> None:
    c = Collector(CollectorConfig(otlp_grpc=None, otlp_http=None, prometheus=None, store=path, max_backlog=10**9))
    rnd = random.Random(1)
    base = time.time_ns() - 3600 * 10**9
    for a in range(0, n, 64):
        req = ExportTraceServiceRequest()
        ss = req.resource_spans.add().scope_spans.add()
        for i in range(a, min(n, a + 64)):
            ss.spans.extend(request_spans(i, base, rnd))
        c.accept(req.SerializeToString())
    c.process(c.assembler.flush())
    c.store_writer.drain()
    t0, t1 = base, base + n * 10 * 10**6 + 2 * 10**9
    starts = np.arange(t0, t1, 5_000_000, dtype=np.int64)
    k = len(starts)
    c.store_writer.put(
        StepBatch(
            trace_id=["cd" * 16] * k,
            span_id=[f"{i:016x}" for i in range(k)],
            service=["engine"] * k,
            start_ns=starts,
            end_ns=starts + 4_000_000,
            step_index=np.arange(k),
            batch_size=np.full(k, 24),
            prefill_tokens=np.zeros(k, np.int64),
            decode_tokens=np.full(k, 24),
            preempted=np.zeros(k, np.int64),
            kv_usage=np.full(k, 0.5),
            gpu_time_ns=np.full(k, -1),
        )
    )
    c.store_writer.drain()
    c.store_writer.close()
    c.store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="otel-llm-report-bench-")
    store, out = os.path.join(tmp, "store.db"), os.path.join(tmp, "report.html")
    build_store(store, a.requests)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "otel_llm", "report", "--store", store, "-o", out], check=True)
    took = time.perf_counter() - t0
    print(
        f"report of {a.requests:,} requests (both boundaries) and their engine steps: "
        f"{os.path.getsize(out) / 2**20:.1f} MiB, written in {took:.1f} s (the whole command, Python start-up included)"
    )


if __name__ == "__main__":
    main()
