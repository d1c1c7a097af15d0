"""Benchmark: what the collector keeps of traces that hold many requests (an agent's calls).

Three cases, as a user hits them, against a real collector (in this process, default assembly
settings: --trace-grace 1, --peer-wait 10, --trace-timeout 30) over OTLP/HTTP, each call sent once
with new span and request ids, the client's spans a moment after the engine's:
  1. otel-llm's client and engine spans under one application span, 3 calls 2.5 s apart;
  2. a GenAI client instrumentation's ``chat <model>`` span with the engine's, the same;
  3. engine spans only under one caller's span, 9 calls 4.5 s apart (longer than --trace-timeout).
Prints, per case, the exports acknowledged, the records stored (of those sent) and
``llm_requests_total`` from /metrics, and the collector's late-span counter. About 70 s.

Run: ``.venv/bin/python benchmarks/agent_traces.py``
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from derive_shapes import set_attributes
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from collector.config import CollectorConfig
from collector.service import Collector
from collector.storage.store import RequestStore
from otel_llm import semconv as sc

MS = 1_000_000


def call(case: int, k: int, who: str) -> bytes:
    """Call ``k`` of a case's trace: the engine's spans, or the client's."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = who
    spans = rs.scope_spans.add().spans
    tid, app = (0xA0 + case).to_bytes(16, "big"), (0xA0 + case).to_bytes(8, "big")
    client_id, engine_id = (1000 * case + 2 * k + 1).to_bytes(8, "big"), (1000 * case + 2 * k + 2).to_bytes(8, "big")
    t0 = time.time_ns() - 200 * MS
    rid = f"cmpl-{case}-{k}-{os.urandom(4).hex()}"
    if who == "engine":
        e = spans.add(trace_id=tid, span_id=engine_id, name=sc.SPAN_REQUEST, kind=Span.SPAN_KIND_SERVER)
        e.parent_span_id = app if case == 3 else client_id
        e.start_time_unix_nano, e.end_time_unix_nano = t0 + 5 * MS, t0 + 150 * MS
        ev = {sc.TOKEN_EVENT_OFFSETS: [40 * MS, 70 * MS], sc.TOKEN_EVENT_TOKENS: [1, 1]}
        set_attributes(e, **{sc.BOUNDARY: "engine", sc.REQUEST_ID: rid, sc.STATUS: "ok", **ev})
        q = spans.add(trace_id=tid, span_id=(10**9 + 1000 * case + k).to_bytes(8, "big"), name=sc.SPAN_QUEUE)
        q.parent_span_id, q.start_time_unix_nano, q.end_time_unix_nano = engine_id, t0 + 6 * MS, t0 + 8 * MS
    elif case == 1:
        c = spans.add(trace_id=tid, span_id=client_id, name=sc.SPAN_CLIENT_REQUEST, kind=Span.SPAN_KIND_CLIENT)
        c.parent_span_id, c.start_time_unix_nano, c.end_time_unix_nano = app, t0, t0 + 160 * MS
        ev = {sc.TOKEN_EVENT_OFFSETS: [50 * MS, 80 * MS], sc.TOKEN_EVENT_TOKENS: [1, 1]}
        set_attributes(c, **{sc.BOUNDARY: "client", sc.REQUEST_ID: rid, sc.STATUS: "ok", **ev})
    else:  # a GenAI client instrumentation's span
        c = spans.add(trace_id=tid, span_id=client_id, name="chat tiny-llama", kind=Span.SPAN_KIND_CLIENT)
        c.parent_span_id, c.start_time_unix_nano, c.end_time_unix_nano = app, t0, t0 + 160 * MS
        set_attributes(
            c,
            **{
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": "tiny-llama",
                sc.RESPONSE_ID: rid,
                "gen_ai.usage.output_tokens": 2,
                sc.RESPONSE_TIME_TO_FIRST_CHUNK: 0.05,
            },
        )
    return req.SerializeToString()


def post(port: int, body: bytes) -> int:
    r = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/traces", body, {"Content-Type": "application/x-protobuf"}, method="POST"
    )
    with urllib.request.urlopen(r, timeout=10) as resp:
        return resp.status


def requests_total(c: Collector) -> dict[str, float]:
    """``llm_requests_total`` by boundary, from the collector's /metrics."""
    host, port = c.prometheus.address[:2]
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^llm_requests_total\{([^}]*)\} (\S+)$", text, re.M):
        b = re.search(r'boundary="(\w+)"', m[1])[1]
        out[b] = out.get(b, 0) + float(m[2])
    return out


def run_case(case: int, n: int, gap: float) -> str:
    with tempfile.TemporaryDirectory() as d:
        store = f"{d}/s.db"
        cfg = CollectorConfig(otlp_grpc="127.0.0.1:0", otlp_http="127.0.0.1:0", prometheus="127.0.0.1:0", store=store)
        c = Collector(cfg).start()
        port, acked, sent = c.receivers[1].address[1], 0, 0
        try:
            for k in range(n):
                acked += post(port, call(case, k, "engine")) == 200
                sent += 1
                if case != 3:
                    time.sleep(0.3)  # the client's span ends after the engine's
                    acked += post(port, call(case, k, "client")) == 200
                    sent += 1
                time.sleep(gap - (0.3 if case != 3 else 0))
            time.sleep(12)  # past --peer-wait and the grace period
            c.process(c.assembler.flush())  # what a stop derives
            counted, late = requests_total(c), c.self_counters()["assembly_spans_late"]
        finally:
            c.stop()
        s = RequestStore(store)
        stored = s.count()
        s.close()
    per_call = 1 if case == 3 else 2
    counts = ", ".join(f"{k} {int(v)}" for k, v in sorted(counted.items())) or "none"
    return (
        f"case {case}: {n} calls x {per_call} records: exports acknowledged {acked} of {sent}, records stored "
        f"{stored} of {n * per_call}, llm_requests_total {counts}, spans_late {late}"
    )


def main() -> None:
    for case, (n, gap) in {1: (3, 2.5), 2: (3, 2.5), 3: (9, 4.5)}.items():
        print(run_case(case, n, gap), flush=True)


if __name__ == "__main__":
    main()
