"""Benchmark: the collector's derivation of one batch of released traces, per trace shape.

Shapes (each trace one request at the client and the engine boundary):
  * direct: the engine's request span is the client span's child (the caller sent a traceparent);
  * proxy: a traced gateway between them, whose span the collector never sees (the engine span's
    parent is unknown: the general matching pairs them by request id);
  * server: an HTTP server span between them (engine_hooks.asgi): three boundaries.

Prints, for n = 1k, 10k, 100k traces, the seconds ``collector.pipeline.derive.derive`` takes and traces/s:
derivation must stay linear in spans for every shape (the proxy shape was O(n^2): 8,000 traces
took 6.7 s).

Run: ``.venv/bin/python benchmarks/derive_shapes.py [--sizes 1000,10000,100000]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from collector.pipeline.assembly import ReleasedTrace
from collector.pipeline.derive import derive
from collector.receivers.decode import decode_payload
from otel_llm import semconv as sc

MS = 1_000_000


def _attrs(span: Span, **kv) -> None:
    for k, v in kv.items():
        a = span.attributes.add(key=k)
        if isinstance(v, str):
            a.value.string_value = v
        elif isinstance(v, int):
            a.value.int_value = v
        else:
            a.value.array_value.values.extend([type(a.value)(int_value=x) for x in v])


def request(i: int, shape: str, t0: int) -> bytes:
    """One request's spans, as an export request."""
    req = ExportTraceServiceRequest()
    spans = req.resource_spans.add().scope_spans.add().spans
    tid = (i + 1).to_bytes(16, "big")
    rid = f"req-{i}"
    client = spans.add(trace_id=tid, span_id=(2 * i + 1).to_bytes(8, "big"), name=sc.SPAN_CLIENT_REQUEST)
    client.start_time_unix_nano, client.end_time_unix_nano = t0, t0 + 180 * MS
    events = dict(zip(("llm.token_event.offsets_ns", "llm.token_event.tokens"), ([100 * MS, 130 * MS], [1, 1])))
    _attrs(client, **{sc.BOUNDARY: "client", sc.REQUEST_ID: rid, sc.STATUS: "ok", **events})
    parent = client.span_id
    if shape == "proxy":
        parent = (10**12 + i).to_bytes(8, "big")  # the gateway's span: never sent
    elif shape == "server":
        srv = spans.add(trace_id=tid, span_id=(10**12 + i).to_bytes(8, "big"), parent_span_id=parent)
        srv.name, srv.kind = "POST /v1/completions", Span.SPAN_KIND_SERVER
        srv.start_time_unix_nano, srv.end_time_unix_nano = t0 + 5 * MS, t0 + 170 * MS
        _attrs(srv, **{sc.BOUNDARY: "server", sc.HTTP_CHUNK_OFFSETS: [90 * MS, 120 * MS]})
        parent = srv.span_id
    eng = spans.add(trace_id=tid, span_id=(2 * i + 2).to_bytes(8, "big"), parent_span_id=parent, name=sc.SPAN_REQUEST)
    eng.start_time_unix_nano, eng.end_time_unix_nano = t0 + 10 * MS, t0 + 160 * MS
    events = dict(zip(("llm.token_event.offsets_ns", "llm.token_event.tokens"), ([75 * MS, 105 * MS], [1, 1])))
    _attrs(eng, **{sc.BOUNDARY: "engine", sc.REQUEST_ID: rid, sc.STATUS: "ok", **events})
    return req.SerializeToString()


def batch(n: int, shape: str, first: int = 0) -> list[ReleasedTrace]:
    """Requests ``first`` .. ``first + n - 1`` of one shape, each its own released trace."""
    t0 = time.time_ns()
    out = []
    for i in range(first, first + n):
        w = decode_payload(request(i, shape, t0 + i * MS))
        out.append(ReleasedTrace(w.spans[0][0], list(w.spans), "grace"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="traces per batch, comma-separated")
    args = ap.parse_args()
    print(f"{'shape':<8} {'traces':>8} {'records':>8} {'paired':>8} {'seconds':>8} {'traces/s':>10}")
    for shape in ("direct", "proxy", "server"):
        for n in map(int, args.sizes.split(",")):
            traces = batch(n, shape)
            t = time.perf_counter()
            records, _ = derive(traces)
            dt = time.perf_counter() - t
            paired = int(records.paired.sum())  # records paired with the other boundary
            print(f"{shape:<8} {n:>8,} {len(records):>8,} {paired:>8,} {dt:>8.3f} {n / dt:>10,.0f}", flush=True)


if __name__ == "__main__":
    main()
