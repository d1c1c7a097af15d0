"""Benchmark: the collector's end-to-end rate against the raw decode-and-walk rate, and its
memory with 100,000 traces in flight. All in one run, one process.

* payloads: realistic export requests as the SDK batches them (512 spans each): per request a
  client span and an engine span with token-event arrays, and the engine's queue / prefill /
  decode / stream spans (6 spans, 64 token events per boundary).
* raw: protobuf parse + a walk touching every span's ids, name, times and attribute keys (no
  attribute values: the floor); and the full walk, which also reads every attribute value through
  protobuf's Python API (the token arrays element by element).
* end-to-end: ``Collector.accept`` (decode, walk, assemble) + release + derivation + metrics
  registry + SQLite store (its writer process), for the same payloads, until every record is
  in SQLite.
* durable: the same end-to-end run with ``--spool`` (every request appended to the write-ahead
  spool before it is accepted; segments deleted as their traces are stored).
* raw and end-to-end alternate over ``--rounds`` rounds and the ratio is taken per round (this
  machine's speed drifts by tens of percent within minutes); the median round is the result.
* where the end-to-end time goes: each stage's share of the rounds' wall time (decode, assembly,
  derivation, metrics, store), measured by wrapping each where the service calls it.
* memory (fresh processes): peak RSS growth with 100,000 traces held in flight (long grace,
  ``--max-inflight-bytes`` lifted: 100,000 traces are more than its 512 MiB default), beside the
  bytes the collector counted for them; then the default bound (what it refuses, retryably); then
  ``--max-traces`` a tenth of that (the ring buffer bounds it).

Run: ``.venv/bin/python benchmarks/collector_throughput.py [--traces 50000]``
Targets: >= 100,000 spans/s end to end, >= 0.5 x the raw rate; memory bounded by --max-traces.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from otel_llm import semconv as sc

MS = 1_000_000


def _kv(key, v) -> KeyValue:
    if isinstance(v, str):
        return KeyValue(key=key, value=AnyValue(string_value=v))
    if isinstance(v, list):
        return KeyValue(key=key, value=AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=x) for x in v])))
    return KeyValue(key=key, value=AnyValue(int_value=v))


def request_spans(i: int, base: int, rnd: random.Random, events: int = 64) -> list[Span]:
    tid = rnd.getrandbits(128).to_bytes(16, "big")
    ids = [rnd.getrandbits(64).to_bytes(8, "big") for _ in range(6)]
    cs = base + i * 10 * MS
    arrival, sched, gen = cs + 2 * MS, cs + 5 * MS, cs + 40 * MS
    gaps = [rnd.randint(5, 40) * MS // 2 for _ in range(events)]
    eng_t = [gen + MS + sum(gaps[:j]) for j in range(events)]
    end = eng_t[-1] + MS
    cl_t = [t + 3 * MS for t in eng_t]

    def span(sid, parent, name, kind, t0, t1, attrs):
        return Span(
            trace_id=tid,
            span_id=sid,
            parent_span_id=parent,
            name=name,
            kind=kind,
            start_time_unix_nano=t0,
            end_time_unix_nano=t1,
            attributes=[_kv(k, v) for k, v in attrs.items()],
        )

    common = {
        sc.REQUEST_ID: f"req-{i}",
        sc.REQUEST_MODEL: "tiny",
        sc.STATUS: "ok",
        sc.INPUT_TOKENS: 128,
        sc.OUTPUT_TOKENS: events,
        sc.TOKEN_EVENT_TOKENS: [1] * events,
    }
    return [
        span(
            ids[0],
            b"",
            sc.SPAN_CLIENT_REQUEST,
            3,
            cs,
            end + 5 * MS,
            {sc.BOUNDARY: "client", **common, sc.TOKEN_EVENT_OFFSETS: [t - cs for t in cl_t]},
        ),
        span(
            ids[1],
            ids[0],
            sc.SPAN_REQUEST,
            2,
            arrival,
            end,
            {sc.BOUNDARY: "engine", **common, sc.TOKEN_EVENT_OFFSETS: [t - arrival for t in eng_t]},
        ),
        span(ids[2], ids[1], sc.SPAN_QUEUE, 1, arrival, sched, {sc.BOUNDARY: "engine"}),
        span(ids[3], ids[1], sc.SPAN_PREFILL, 1, sched, gen, {sc.BOUNDARY: "engine"}),
        span(ids[4], ids[1], sc.SPAN_DECODE, 1, gen, eng_t[-1], {sc.BOUNDARY: "engine"}),
        span(ids[5], ids[1], sc.SPAN_STREAM, 1, eng_t[0], eng_t[-1], {sc.BOUNDARY: "engine"}),
    ]


def payloads(n_traces: int, seed: int = 0, spans_per_payload: int = 512) -> tuple[list[bytes], int]:
    rnd = random.Random(seed)
    base = time.time_ns()
    out, batch, total = [], [], 0
    for i in range(n_traces):
        batch.extend(request_spans(i, base, rnd))
        if len(batch) >= spans_per_payload or i == n_traces - 1:
            req = ExportTraceServiceRequest()
            rs = req.resource_spans.add()
            rs.resource.attributes.append(_kv("service.name", "bench"))
            rs.scope_spans.add().spans.extend(batch)
            out.append(req.SerializeToString())
            total += len(batch)
            batch = []
    return out, total


def _parse_rate(bodies: list[bytes], total: int, walk) -> float:
    """Spans/s of protobuf's parse plus ``walk(request) -> spans visited``."""
    gc.collect()
    t0 = time.perf_counter()
    n = 0
    for body in bodies:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        n += walk(req)
    assert n == total
    return total / (time.perf_counter() - t0)


def full_walk_rate(bodies: list[bytes], total: int) -> float:
    """Parse + every span with its attribute values through protobuf's Python API (what a
    straightforward OTLP reader pays to see the token arrays at all)."""
    from otel_llm.otlp.span_records import spans_from_request

    return _parse_rate(bodies, total, lambda req: sum(1 for _ in spans_from_request(req)))


def _minimal_walk(req) -> int:
    n = 0
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            for s in ss.spans:
                _ = (s.trace_id, s.span_id, s.parent_span_id, s.name, s.start_time_unix_nano, s.end_time_unix_nano)
                for kv in s.attributes:
                    _ = kv.key
                n += 1
    return n


def raw_rate(bodies: list[bytes], total: int) -> float:
    """Parse + a walk touching every span's ids, name, times and attribute keys (the floor)."""
    return _parse_rate(bodies, total, _minimal_walk)


def make_collector(
    store: str, max_traces: int, grace_s: float = 0.0, spool: str | None = None, max_inflight_bytes: int = 512 << 20
):
    from collector.config import CollectorConfig
    from collector.pipeline.assembly import AssemblyConfig
    from collector.service import Collector
    from otel_llm.metrics.slo import SLO

    cfg = CollectorConfig(
        otlp_grpc=None,
        otlp_http=None,
        prometheus=None,
        store=store,
        assembly=AssemblyConfig(grace_s=grace_s, timeout_s=3600, max_traces=max_traces),
        slos={"default": SLO(ttft=1, tpot=0.05)},
        max_backlog=10**9,
        spool=spool,
        spool_max_bytes=1 << 40,
        max_inflight_bytes=max_inflight_bytes,
    )
    return Collector(cfg)  # not started: the benchmark drives it


class StageClock:
    """Wall time (s) spent in each stage of the collector's pipeline during a run: ``decode``
    (parse and walk a request), ``assembly`` (group its spans, release traces), ``derivation``,
    ``metrics`` (the registry), ``store`` (handing the records to the writer process, and the
    wait for it at the end), each wrapped where the service calls it."""

    STAGES = ("decode", "assembly", "derivation", "metrics", "store")

    def __init__(self):
        self.spent = dict.fromkeys(self.STAGES, 0.0)

    def timed(self, stage: str, fn):
        spent = self.spent

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[stage] += time.perf_counter() - t0

        return wrapper

    def attach(self, c) -> None:
        import collector.service as service

        self._restore = (service.decode_payload, service.derive)
        service.decode_payload = self.timed("decode", service.decode_payload)
        service.derive = self.timed("derivation", service.derive)
        c.assembler.add = self.timed("assembly", c.assembler.add)
        c.assembler.expire = self.timed("assembly", c.assembler.expire)
        c.assembler.flush = self.timed("assembly", c.assembler.flush)
        c.registry.record = self.timed("metrics", c.registry.record)
        c.store_writer.put = self.timed("store", c.store_writer.put)
        c.store_writer.drain = self.timed("store", c.store_writer.drain)

    def detach(self) -> None:
        import collector.service as service

        service.decode_payload, service.derive = self._restore


def end_to_end_rate(
    bodies: list[bytes], total: int, n_traces: int, tmp: str, spool: bool = False, clock: StageClock | None = None
) -> tuple[float, int]:
    import shutil

    path = os.path.join(tmp, "e2e.db")
    spool_dir = os.path.join(tmp, "spool")
    shutil.rmtree(spool_dir, ignore_errors=True)
    for f in (path, path + "-wal", path + "-shm"):
        if os.path.exists(f):
            os.remove(f)
    c = make_collector(path, max_traces=100_000, spool=spool_dir if spool else None)
    c.store_writer.wait_ready(30)  # its start-up is not part of the rate
    if clock is not None:
        clock.attach(c)
    gc.collect()
    t0 = time.perf_counter()
    for i, body in enumerate(bodies):
        c.accept(body)
        if i % 8 == 7:
            c.tick(now=time.monotonic() + 1)  # grace 0: every trace whose request spans are in is ready
    c.process(c.assembler.flush())
    c.store_writer.drain()  # every record is in SQLite before the clock stops
    dt = time.perf_counter() - t0
    if clock is not None:
        clock.detach()
        clock.spent["total"] = dt
    stored = c.store.count()
    assert stored == 2 * n_traces, stored
    c.store_writer.close()
    c.store.close()
    if c.spool is not None:
        c.spool.close()
        shutil.rmtree(spool_dir, ignore_errors=True)
    for f in (path, path + "-wal", path + "-shm"):  # deleted, its dirty pages are never written back
        if os.path.exists(f):  # (the kernel's write-back would slow the next round)
            os.remove(f)
    return total / dt, stored


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_in_flight(n_traces: int, max_traces: int, max_inflight_bytes: int) -> None:
    """Child-process mode: RSS growth while ``n_traces`` arrive and at most ``max_traces`` (and
    ``max_inflight_bytes`` counted) are held; requests refused by the byte bound are counted."""
    from collector.receivers.intake import Overloaded

    tmp = tempfile.mkdtemp(prefix="otel-llm-collector-mem-")
    bodies, _ = payloads(n_traces, seed=1)
    gc.collect()
    before = rss_bytes()
    c = make_collector(
        os.path.join(tmp, "mem.db"), max_traces=max_traces, grace_s=3600, max_inflight_bytes=max_inflight_bytes
    )
    peak = counted = refused = 0
    for body in bodies:
        try:
            c.accept(body)
        except Overloaded:  # 503 to a sender: retryable, nothing kept
            refused += 1
        c.process([])  # traces evicted past the bound are derived and stored, so they leave memory
        peak = max(peak, rss_bytes() - before)
        counted = max(counted, c.inflight_bytes())
    with open(f"/proc/{c.store_writer.pid}/status") as fh:  # the store writer process, for the record
        writer = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
    print(f"{len(c.assembler)} {c.assembler.counters.traces_evicted} {peak} {writer} {counted} {refused}")


def memory_run(n_traces: int, max_traces: int, max_inflight_bytes: int) -> tuple[int, ...]:
    """(traces held, derived early, peak RSS growth, store writer peak, peak counted in-flight
    bytes, requests refused), from a fresh process."""
    import subprocess

    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", str(n_traces), str(max_traces), str(max_inflight_bytes)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return tuple(map(int, out[-6:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=int, default=50_000, help="traces for the rate runs (default 50,000)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating raw / end-to-end rounds (default 3)")
    ap.add_argument("--in-flight", type=int, default=100_000, help="traces held for the memory run (default 100,000)")
    ap.add_argument("--memory-child", nargs=3, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.memory_child:
        memory_in_flight(*a.memory_child)
        return
    tmp = tempfile.mkdtemp(prefix="otel-llm-collector-bench-")
    bodies, total = payloads(a.traces)
    mib = sum(map(len, bodies)) / 2**20
    print(
        f"payloads: {a.traces:,} traces, {total:,} spans in {len(bodies)} requests ({mib:.1f} MiB protobuf)", flush=True
    )
    rounds, clocks = [], []
    for r in range(a.rounds):
        raw = raw_rate(bodies, total)
        full = full_walk_rate(bodies, total) if r == 0 else None
        clocks.append(StageClock())
        e2e, stored = end_to_end_rate(bodies, total, a.traces, tmp, clock=clocks[-1])
        durable, _ = end_to_end_rate(bodies, total, a.traces, tmp, spool=True)
        rounds.append((e2e / raw, raw, e2e, durable, durable / e2e))
        print(
            f"round {r + 1}: raw decode-and-walk (ids, names, times, attribute keys) {raw:,.0f} spans/s; "
            f"end to end (decode, assemble, derive, metrics, store) {e2e:,.0f} spans/s "
            f"({stored:,} records stored); ratio {e2e / raw:.2f}; "
            f"durable (--spool) {durable:,.0f} spans/s, {durable / e2e:.2f} of end to end",
            flush=True,
        )
        if full:
            print(
                f"         full decode-and-walk (every attribute value, protobuf Python API) {full:,.0f} spans/s; "
                f"end to end / full: {e2e / full:.2f}",
                flush=True,
            )
    med = lambda xs: sorted(xs)[len(xs) // 2]
    print(
        f"median of {len(rounds)} rounds: end to end {med([x[2] for x in rounds]):,.0f} spans/s (target >= 100,000); "
        f"raw {med([x[1] for x in rounds]):,.0f} spans/s; end-to-end / raw {med([x[0] for x in rounds]):.2f} "
        f"(target >= 0.5; per round {', '.join(f'{x[0]:.2f}' for x in rounds)})",
        flush=True,
    )
    print(
        f"durable mode (--spool): {med([x[3] for x in rounds]):,.0f} spans/s, {med([x[4] for x in rounds]):.2f} of "
        f"end to end without it (per round {', '.join(f'{x[4]:.2f}' for x in rounds)})",
        flush=True,
    )
    spent = {k: med([c.spent[k] for c in clocks]) for k in (*StageClock.STAGES, "total")}
    parts = ", ".join(f"{k} {spent[k] / spent['total']:.0%}" for k in StageClock.STAGES)
    rest = 1 - sum(spent[k] for k in StageClock.STAGES) / spent["total"]
    print(f"where end to end goes (median of the rounds' wall time): {parts}, the rest {rest:.0%}", flush=True)
    del bodies
    MiB = 2**20
    held, _, peak, writer, counted, _ = memory_run(a.in_flight, a.in_flight, 1 << 40)
    print(
        f"memory: {held:,} traces in flight (--max-inflight-bytes lifted) -> peak RSS +{peak / MiB:,.0f} MiB "
        f"({peak / max(held, 1):,.0f} bytes/trace), counted in flight {counted / MiB:,.0f} MiB "
        f"(counted / RSS {counted / max(peak, 1):.2f}); store writer process peak {writer / MiB:,.0f} MiB",
        flush=True,
    )
    held_d, _, peak_d, _, counted_d, refused_d = memory_run(a.in_flight, a.in_flight, 512 << 20)
    print(
        f"memory with the default --max-inflight-bytes 512 MiB: {held_d:,} in flight, {refused_d:,} requests "
        f"refused (503, retryable) -> peak RSS +{peak_d / MiB:,.0f} MiB, counted {counted_d / MiB:,.0f} MiB",
        flush=True,
    )
    bound = max(a.in_flight // 10, 1)
    held_b, ev, peak_b, writer_b, _, _ = memory_run(a.in_flight, bound, 1 << 40)
    print(
        f"memory with --max-traces {bound}: {held_b:,} in flight, {ev:,} derived early -> "
        f"peak RSS +{peak_b / MiB:,.0f} MiB; store writer process peak {writer_b / MiB:,.0f} MiB"
    )


if __name__ == "__main__":
    main()
