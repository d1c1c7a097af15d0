"""Benchmark: the collector's derivation of one batch of released traces, per trace shape.

Shapes (each trace one request at the client and the engine boundary):
  * direct: the engine's request span is the client span's child (the caller sent a traceparent);
  * proxy: a traced gateway between them, whose span the collector never sees (the engine span's
    parent is unknown: the general matching pairs them by request id);
  * server: an HTTP server span between them (engine_hooks.asgi): three boundaries;
  * agent-direct, agent-proxy: the direct and proxy shapes with every request in ONE trace, under
    one application span (an agent's or a chain's calls): released as one trace (the worst case
    for pairing inside a trace), and assembled call by call as the collector takes them (each call
    released when complete: "assembled" is the assembler's seconds for all of them).

Prints, for n = 1k, 10k, 100k requests, the seconds ``collector.pipeline.derive.derive`` takes and
requests/s: derivation must stay linear in spans for every shape (the proxy shape was O(n^2): 8,000
traces took 6.7 s), and so must a trace of many requests, derived at once or call by call.

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

from collector.pipeline.assembly import AssemblyConfig, ReleasedTrace, TraceAssembler
from collector.pipeline.derive import derive
from collector.receivers.decode import decode_payload
from otel_llm import semconv as sc

MS = 1_000_000


def set_attributes(span: Span, **kv) -> None:
    """OTLP attributes on a hand-built span: str, float, int, or a list of ints."""
    for k, v in kv.items():
        a = span.attributes.add(key=k)
        if isinstance(v, str):
            a.value.string_value = v
        elif isinstance(v, float):
            a.value.double_value = v
        elif isinstance(v, int):
            a.value.int_value = v
        else:
            a.value.array_value.values.extend([type(a.value)(int_value=x) for x in v])


APP = (2**62).to_bytes(8, "big")  # the application span of the agent shapes (never sent)


def request(i: int, shape: str, t0: int) -> bytes:
    """One request's spans, as an export request."""
    req = ExportTraceServiceRequest()
    spans = req.resource_spans.add().scope_spans.add().spans
    agent = shape.startswith("agent-")
    shape = shape.removeprefix("agent-")
    tid = (1 if agent else i + 1).to_bytes(16, "big")
    rid = f"req-{i}"
    client = spans.add(trace_id=tid, span_id=(2 * i + 1).to_bytes(8, "big"), name=sc.SPAN_CLIENT_REQUEST)
    if agent:
        client.parent_span_id = APP
    client.start_time_unix_nano, client.end_time_unix_nano = t0, t0 + 180 * MS
    events = dict(zip(("llm.token_event.offsets_ns", "llm.token_event.tokens"), ([100 * MS, 130 * MS], [1, 1])))
    set_attributes(client, **{sc.BOUNDARY: "client", sc.REQUEST_ID: rid, sc.STATUS: "ok", **events})
    parent = client.span_id
    if shape == "proxy":
        parent = (10**12 + i).to_bytes(8, "big")  # the gateway's span: never sent
    elif shape == "server":
        srv = spans.add(trace_id=tid, span_id=(10**12 + i).to_bytes(8, "big"), parent_span_id=parent)
        srv.name, srv.kind = "POST /v1/completions", Span.SPAN_KIND_SERVER
        srv.start_time_unix_nano, srv.end_time_unix_nano = t0 + 5 * MS, t0 + 170 * MS
        set_attributes(srv, **{sc.BOUNDARY: "server", sc.HTTP_CHUNK_OFFSETS: [90 * MS, 120 * MS]})
        parent = srv.span_id
    eng = spans.add(trace_id=tid, span_id=(2 * i + 2).to_bytes(8, "big"), parent_span_id=parent, name=sc.SPAN_REQUEST)
    eng.start_time_unix_nano, eng.end_time_unix_nano = t0 + 10 * MS, t0 + 160 * MS
    events = dict(zip(("llm.token_event.offsets_ns", "llm.token_event.tokens"), ([75 * MS, 105 * MS], [1, 1])))
    set_attributes(eng, **{sc.BOUNDARY: "engine", sc.REQUEST_ID: rid, sc.STATUS: "ok", **events})
    return req.SerializeToString()


def batch(n: int, shape: str, first: int = 0) -> list[ReleasedTrace]:
    """Requests ``first`` .. ``first + n - 1`` of one shape, each its own released trace (the agent
    shapes: all in one)."""
    t0 = time.time_ns()
    out = []
    for i in range(first, first + n):
        w = decode_payload(request(i, shape, t0 + i * MS))
        out.append(ReleasedTrace(w.spans[0][0], list(w.spans), "grace"))
    if shape.startswith("agent-"):
        return [ReleasedTrace(out[0].trace_id, [s for t in out for s in t.spans], "grace")]
    return out


def assembled(n: int, shape: str) -> tuple[list[ReleasedTrace], float]:
    """The agent shapes as the collector takes them: one call a second, each released when
    complete (the assembler's grace period); the released groups and the assembler's seconds."""
    calls = batch(n, shape.replace("agent-", ""))
    tid = (1).to_bytes(16, "big")
    asm = TraceAssembler(AssemblyConfig(grace_s=0.5, peer_wait_s=10.0, timeout_s=30.0, max_spans_per_trace=10**6))
    out: list[ReleasedTrace] = []
    t = time.perf_counter()
    for i, c in enumerate(calls):
        out += asm.expire(float(i))
        out += asm.add([(tid, *s[1:2], APP if s[3] == 0 else s[2], *s[3:]) for s in c.spans], float(i))
    out += asm.expire(float(n + 60))
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="traces per batch, comma-separated")
    args = ap.parse_args()
    head = f"{'shape':<26} {'requests':>8} {'records':>8} {'paired':>8} {'seconds':>8} {'requests/s':>10}"
    print(head + f" {'assembled':>9}")
    shapes = ("direct", "proxy", "server", "agent-direct", "agent-proxy", "agent-direct call by call")
    for shape in shapes:
        for n in map(int, args.sizes.split(",")):
            by_call = shape.endswith(" call by call")
            if by_call:
                traces, asm_s = assembled(n, shape.split()[0])
            else:
                traces, asm_s = batch(n, shape), None
            t = time.perf_counter()
            records, _ = derive(traces)
            dt = time.perf_counter() - t
            paired = int(records.paired.sum())  # records paired with the other boundary
            line = f"{shape:<26} {n:>8,} {len(records):>8,} {paired:>8,} {dt:>8.3f} {n / dt:>10,.0f}"
            print(line + ("" if asm_s is None else f" {asm_s:>9.3f}"), flush=True)


if __name__ == "__main__":
    main()
