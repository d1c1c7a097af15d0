"""Benchmark: how fast the metric core derives window statistics.

Prints, from one run:
  * requests/s for deriving every metric (request_metrics + summarize with an SLO) over
    1,000,000 in-memory requests (target: >= 200,000 requests/s on the 2-core dev machine);
  * the file-parsing rate of ``otel-llm analyze`` input (JSON lines -> TimelineBatch), separately.

Run: ``.venv/bin/python benchmarks/derive_throughput.py [--requests N] [--parse-requests N]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from otel_llm import SLO, TimelineBatch, request_metrics, summarize
from otel_llm.metrics.timeline_file import read_timelines


def synthetic_batch(n: int, seed: int = 0) -> TimelineBatch:
    """n requests, 1..32 token events each, Poisson arrivals, mostly ok."""
    rng = np.random.default_rng(seed)
    submit = np.cumsum(rng.exponential(0.01, n))
    m = rng.integers(1, 33, n)
    req = np.repeat(np.arange(n), m)
    ttft = rng.gamma(2.0, 0.1, n)
    gaps = rng.gamma(2.0, 0.01, len(req))
    # time of event j of request i = submit + ttft + cumulative gaps within the request
    cs = np.cumsum(gaps)
    starts = np.repeat(np.cumsum(m) - m, m)
    within = cs - cs[starts]
    et = submit[req] + ttft[req] + within
    tokens = np.where(rng.random(len(req)) < 0.05, 2, 1)
    last = np.zeros(n)
    np.maximum.at(last, req, et)
    end = last + 0.001
    status = np.where(rng.random(n) < 0.98, 0, rng.integers(1, 4, n))
    return TimelineBatch.from_columns(
        [str(i) for i in range(n)], submit, end, status, req, et, tokens, rng.integers(16, 512, n)
    )


def bench_derive(n: int) -> float:
    batch = synthetic_batch(n)
    events = int(batch.offsets[-1])
    slo = SLO(ttft=0.5, tpot=0.03, itl_max=0.1, e2e=2.0)
    t0 = time.perf_counter()
    s = summarize(batch, slo=slo, ps=["50", "90", "95", "99", "99.9"], rm=request_metrics(batch))
    dt = time.perf_counter() - t0
    rate = n / dt
    print(
        f"derive:  {n:,} requests, {events:,} token events, {s.latency['itl'].n:,} ITL samples "
        f"in {dt:.3f} s -> {rate:,.0f} requests/s (target >= 200,000)"
    )
    return rate


def bench_parse(n: int) -> float:
    batch = synthetic_batch(n, seed=1)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as fh:
        for i in range(n):
            a, b = batch.offsets[i], batch.offsets[i + 1]
            fh.write(
                json.dumps(
                    {
                        "id": batch.ids[i],
                        "submit": float(batch.submit[i]),
                        "end": float(batch.end[i]),
                        "status": ["ok", "error", "cancelled", "rejected"][batch.status[i]],
                        "events": [
                            [t, k] for t, k in zip(batch.event_time[a:b].tolist(), batch.event_tokens[a:b].tolist())
                        ],
                        "input_tokens": int(batch.input_tokens[i]),
                    }
                )
                + "\n"
            )
        path = fh.name
    size = os.path.getsize(path)
    try:
        t0 = time.perf_counter()
        parsed = read_timelines(path)
        dt = time.perf_counter() - t0
    finally:
        os.unlink(path)
    assert len(parsed) == n
    rate = n / dt
    print(
        f"parse:   {n:,} requests ({size / 2**20:.1f} MiB of JSON lines) in {dt:.3f} s -> "
        f"{rate:,.0f} requests/s, {size / 2**20 / dt:.1f} MiB/s"
    )
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1_000_000, help="in-memory requests to derive (default 1,000,000)")
    ap.add_argument("--parse-requests", type=int, default=100_000, help="requests in the parsed file (default 100,000)")
    a = ap.parse_args()
    bench_derive(a.requests)
    bench_parse(a.parse_requests)


if __name__ == "__main__":
    main()
