"""Derivation time of one trace that holds N client spans and N chained engine spans (each engine
span the child of the one before, the first the child of the first client span): the shape that
made pairing quadratic. Prints seconds and microseconds per span for each N; one run.

    .venv/bin/python benchmarks/pairing.py [N ...]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from collector.pipeline.assembly import ReleasedTrace
from collector.pipeline.derive import derive
from collector.pipeline.walked_span import make_span
from otel_llm import semconv as sc

MS = 1_000_000


def trace(n: int) -> ReleasedTrace:
    t = "ee" * 16
    sid = lambda kind, i: (kind + i.to_bytes(7, "big")).hex()
    spans = []
    for i in range(n):
        spans.append(
            make_span(
                t,
                sid(b"c", i),
                sc.SPAN_CLIENT_REQUEST,
                start=0,
                end=100 * MS,
                request_id=f"r{i}",
                offsets=[50 * MS],
                tokens=[1],
            )
        )
    for i in range(n):
        parent = sid(b"c", 0) if i == 0 else sid(b"e", i - 1)
        spans.append(
            make_span(
                t,
                sid(b"e", i),
                sc.SPAN_REQUEST,
                parent=parent,
                start=1 * MS,
                end=90 * MS,
                request_id=f"r{i}",
                offsets=[40 * MS],
                tokens=[1],
            )
        )
    return ReleasedTrace(bytes.fromhex(t), spans, "grace")


def main(sizes: list[int]) -> None:
    for n in sizes:
        tr = trace(n)
        t0 = time.perf_counter()
        batch, _ = derive([tr])
        dt = time.perf_counter() - t0
        paired = int(batch.paired.sum()) // 2
        print(f"N = {n:>6,}: {dt:7.3f} s for {2 * n:,} spans ({dt / (2 * n) * 1e6:6.1f} us/span), {paired:,} pairs")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [800, 1600, 6400, 29000])
