"""Benchmark: CPU per traced request to build and encode its spans, the SDK's encoders against
otel_llm's (one run, same spans). A request here: 256 token events, one preemption, a caller's
traceparent on half of them: 6 spans.

Run: ``.venv/bin/python benchmarks/span_encoding.py [--requests 500] [--events 256]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode

from engine_hooks.spans.span_factory import SpanFactory
from engine_hooks.spans.tracker import FinishedRequest
from otel_llm.otlp import otlp_encode
from otel_llm.otlp.otlp_json import to_json
from otel_llm.otlp.tracing import make_resource


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--events", type=int, default=256)
    a = ap.parse_args()
    n, m = a.requests, a.events
    f = SpanFactory(make_resource("bench"), "engine", "vllm")
    now = time.time_ns()
    tp = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    recs = [
        FinishedRequest(  # by keyword: the record grows fields
            request_id=str(i),
            start_ns=now,
            end_ns=now + 10**9,
            status="ok",
            finish_reason="length",
            trace_headers=tp if i % 2 else None,
            input_tokens=32,
            queued_ns=now + 5 * 10**5,
            first_scheduled_ns=now + 10**6,
            first_generated_ns=now + 2 * 10**6,
            last_generated_ns=now + 9 * 10**8,
            generated_tokens=m,
            preemptions=[(now + 5 * 10**6, now + 6 * 10**6, "recompute")],
            preemption_tokens=[40],
            out_times_ns=[now + 2 * 10**6 + j * 3 * 10**6 for j in range(m)],
            out_tokens=[1] * m,
        )
        for i in range(n)
    ]

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) / n * 1e6

    spans, build = timed(lambda: [s for r in recs for s in f.request_spans(r)])
    sdk_pb, t_sdk = timed(lambda: sdk_encode(spans))
    fast_pb, t_fast = timed(lambda: otlp_encode.encode_spans(spans))
    _, t_sdk_json = timed(lambda: to_json(sdk_encode(spans)))
    _, t_fast_json = timed(lambda: otlp_encode.spans_to_json(spans))
    assert fast_pb == sdk_pb
    print(f"{n} requests x {len(spans) // n} spans, {m} token events each (us of CPU per request)")
    print(f"build spans:          {build:8.1f}")
    print(f"OTLP protobuf:  SDK {t_sdk:8.1f}   otel_llm {t_fast:8.1f}   ({t_sdk / t_fast:.1f}x)")
    print(f"OTLP/JSON line: SDK {t_sdk_json:8.1f}   otel_llm {t_fast_json:8.1f}   ({t_sdk_json / t_fast_json:.1f}x)")


if __name__ == "__main__":
    main()
