"""Past one collector: three real collectors, each trace's spans routed to one of them by its trace
id (standing in for the OpenTelemetry Collector's loadbalancing exporter with routing_key
traceID), against one collector fed the same spans. A real Prometheus scrapes all four: PromQL
sums over the shards equal the single collector's counts and buckets; ``analyze`` over the three
stores equals ``analyze`` over the single one, field by field; a trace split across two shards on
purpose gives each shard the record of the boundary it saw, unpaired, never a pair twice; ``compare``
over the three stores pairs those two by their request id, once, the parts that need both records'
times unknown. The records also leave as OTLP log records and as Parquet, equal to the store's."""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import ROOT, run_cli
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from support.otlp_helpers import Req, sample_request

from otel_llm.metrics.slo import SLO

HISTOGRAMS = (
    "gen_ai_server_time_to_first_token_seconds",
    "gen_ai_server_time_per_output_token_seconds",
    "gen_ai_server_request_duration_seconds",
    "llm_inter_token_latency_seconds",
    "llm_queue_duration_seconds",
)
COUNTERS = ("llm_requests_total", "llm_usage_output_tokens_total", "llm_slo_good_requests_total")


def requests(n: int, seed: int = 3) -> list[Req]:
    """Requests with times on bucket bounds (TTFT exactly 100 ms, TPOT exactly 10 ms: where
    rounding decides a bucket) and off them."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        if i % 3 == 0:
            ttft, gap = 100, 10  # on the bounds le=0.1 and le=0.01
        else:
            ttft, gap = rnd.uniform(20, 300), rnd.uniform(2, 40)
        k = rnd.randint(2, 12)
        ce = [(ttft + j * gap, 1) for j in range(k)]
        ee = [(t - rnd.uniform(1, 5), 1) for t, _ in ce]
        out.append(
            Req(
                f"q{i}",
                client_events=ce,
                client_end=ce[-1][0] + 1,
                arrival=rnd.uniform(1, 5),
                first_scheduled=ee[0][0] - 8,
                first_generated=ee[0][0] - 1,
                engine_events=ee,
                engine_end=ee[-1][0] + 0.5,
                status="ok" if i % 17 else "error",
            )
        )
    return out


def shard_of(trace_id: bytes, n: int) -> int:
    """The routing rule's stand-in: a hash of the trace id (the loadbalancing exporter hashes the
    trace id onto a ring of its backends; any stable function of the trace id routes the same)."""
    return int.from_bytes(hashlib.sha256(trace_id).digest()[:8], "big") % n


def _trace_id(req: ExportTraceServiceRequest) -> bytes:
    return req.resource_spans[0].scope_spans[0].spans[0].trace_id


def _split(req: ExportTraceServiceRequest) -> tuple[ExportTraceServiceRequest, ExportTraceServiceRequest]:
    """The client span alone, and the engine's spans alone."""
    a, b = ExportTraceServiceRequest(), ExportTraceServiceRequest()
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            for s in ss.spans:
                dst = a if s.name == "llm.client.request" else b
                dst.resource_spans.add().scope_spans.add().spans.append(s)
    return a, b


def _merge(reqs: list[ExportTraceServiceRequest]) -> bytes:
    out = ExportTraceServiceRequest()
    for r in reqs:
        out.resource_spans.extend(r.resource_spans)
    return out.SerializeToString()


def promql(port: int, q: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(url, timeout=10) as r:
        d = json.load(r)
    assert d["status"] == "success", d
    return d["data"]["result"]


def _settle(collectors, n_records: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(c.records_derived for c in collectors) >= n_records:
            break
        time.sleep(0.1)
    for c in collectors:
        c.store_writer.drain()


@pytest.mark.slow
def test_three_shards_equal_one_collector(make_collector, prometheus_jobs):
    slo = {"default": SLO(ttft=0.15, tpot=0.02)}
    shards = [make_collector(slos=slo, instance_id=f"shard-{i}") for i in range(3)]
    single = make_collector(slos=slo, instance_id="single")
    prom = prometheus_jobs(
        {"shards": [c.prometheus.address[1] for c in shards], "single": [single.prometheus.address[1]]}
    )
    specs = requests(240)
    reqs = [sample_request([r]) for r in specs]
    split_req = reqs.pop()  # this trace reaches two shards: its client span one, its engine spans another
    split_req_id = specs[-1].id
    routed: list[list[ExportTraceServiceRequest]] = [[], [], []]
    for r in reqs:
        routed[shard_of(_trace_id(r), 3)].append(r)
    client_half, engine_half = _split(split_req)
    a = shard_of(_trace_id(split_req), 3)
    routed[a].append(client_half)
    routed[(a + 1) % 3].append(engine_half)
    assert all(len(x) > 40 for x in routed)
    # each collector gets its export requests in batches of different sizes: derivation batches differ
    for i, rs in enumerate(routed):
        for k in range(0, len(rs), 7 + i):
            shards[i].accept(_merge(rs[k : k + 7 + i]))
    everything = [*reqs, split_req]
    for k in range(0, len(everything), 50):
        single.accept(_merge(everything[k : k + 50]))
    n = 2 * len(everything)
    _settle(shards, n)
    _settle([single], n)
    assert sum(c.records_derived for c in shards) == single.records_derived == n
    time.sleep(3)  # a few scrapes after the last record

    def by(job: str, q: str, labels: tuple[str, ...]) -> dict:
        res = promql(prom, q.replace("JOB", job))
        return {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1]) for s in res}

    for h in HISTOGRAMS:
        q = f'sum by (le, boundary) ({h}_bucket{{job="JOB"}})'
        single_b = by("single", q, ("le", "boundary"))
        assert single_b and by("shards", q, ("le", "boundary")) == single_b, h
        q = f'sum by (boundary) ({h}_count{{job="JOB"}})'
        assert by("shards", q, ("boundary",)) == by("single", q, ("boundary",)), h
    for cnt in COUNTERS:
        q = f'sum by (boundary, status, slo) ({cnt}{{job="JOB"}})'
        assert by("shards", q, ("boundary", "status", "slo")) == by("single", q, ("boundary", "status", "slo")), cnt
    # each shard's series say which shard they are from
    inst = {s["metric"]["collector_instance"] for s in promql(prom, 'llm_requests_total{job="shards"}')}
    assert inst == {"shard-0", "shard-1", "shard-2"}
    # the split trace: paired on the single collector, a record on each of two shards, unpaired there
    parts_single = by("single", 'sum(llm_ttft_part_seconds_count{job="JOB",part="queue"})', ())
    parts_shards = by("shards", 'sum(llm_ttft_part_seconds_count{job="JOB",part="queue"})', ())
    assert parts_single[()] - parts_shards[()] == 1  # one pair fewer, never two
    # analyze over the three stores = analyze over the single store, field by field
    stores = [c.config.store for c in shards]
    for boundary in ("client", "engine"):
        args = ("--boundary", boundary, "--slo", "ttft=0.15,tpot=0.02", "--format", "json")
        merged = json.loads(run_cli("analyze", *[x for s in stores for x in ("--store", s)], *args).stdout)
        one = json.loads(run_cli("analyze", "--store", single.config.store, *args).stdout)
        assert merged == one, boundary
    glob = str(shards[0].config.store).replace("store0", "store[0-2]")
    assert json.loads(run_cli("analyze", "--store", glob, "--format", "json").stdout) == json.loads(
        run_cli("analyze", "--store", single.config.store, "--format", "json").stdout
    )
    # compare: the split trace is one unpaired record on each side, which compare over the three
    # stores pairs by the request id (once); everything else paired once, by trace
    cmp_shards = json.loads(run_cli("compare", *[x for s in stores for x in ("--store", s)], "--format", "json").stdout)
    cmp_single = json.loads(run_cli("compare", "--store", single.config.store, "--format", "json").stdout)
    assert cmp_single["summary"]["requests_paired"] == len(everything)
    assert cmp_shards["summary"]["requests_paired"] == len(everything)
    assert cmp_shards["summary"]["records_unpaired"] == 0
    by_id = [r for r in cmp_shards["requests"] if r["paired_by"] == "id"]
    assert [r["id"] for r in by_id] == [split_req_id] and by_id[0]["network_in"] is None
    assert by_id[0]["queue"] is not None and by_id[0]["client_e2e"] is not None


class _LogsReceiver:
    """A small OTLP/HTTP logs receiver: keeps every ExportLogsServiceRequest posted to /v1/logs."""

    def __init__(self):
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

        self.requests: list = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.path == "/v1/logs" and self.headers["Content-Type"] == "application/x-protobuf"
                outer.requests.append(ExportLogsServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _value(v):
    which = v.WhichOneof("value")
    if which == "array_value":
        return [x.int_value for x in v.array_value.values]
    return getattr(v, which)


def test_records_leave_as_otlp_log_records(make_collector):
    from collector.storage.store import open_existing

    rx = _LogsReceiver()
    c = make_collector(forward_records=f"http://127.0.0.1:{rx.port}", instance_id="c1")
    c.accept(sample_request(requests(12)).SerializeToString())
    _settle([c], 24)
    c.stop()
    rx.server.shutdown()
    logs = [
        (rl.resource, lr)
        for r in rx.requests
        for rl in r.resource_logs
        for sl in rl.scope_logs
        for lr in sl.log_records
    ]
    s = open_existing(c.config.store)
    stored = {(r.trace_id, r.boundary, r.request_id): r for r in s.records()}
    s.close()
    assert len(logs) == len(stored) == 24
    for resource, lr in logs:
        attrs = {kv.key: _value(kv.value) for kv in lr.attributes}
        res = {kv.key: kv.value.string_value for kv in resource.attributes}
        assert res == {"service.name": "otel-llm-collector", "service.instance.id": "c1"}
        key = (attrs["otel_llm.trace_id"], attrs["otel_llm.boundary"], attrs["otel_llm.request_id"])
        r = stored[key]
        assert lr.event_name == "otel_llm.request" and lr.trace_id.hex() == r.trace_id
        assert lr.time_unix_nano == r.end_ns and attrs["otel_llm.submit_ns"] == r.submit_ns
        assert attrs["otel_llm.ttft"] == r.ttft and attrs["otel_llm.output_tokens"] == r.output_tokens
        assert attrs["otel_llm.event_offsets_ns"] == list(r.event_offsets_ns)
        assert attrs.get("otel_llm.tpot") == r.tpot


def test_parquet_export_equals_the_store(tmp_path):
    import pyarrow.parquet as pq

    from collector.storage.store import open_existing

    store = ROOT / "tests" / "data" / "demo_store.db"
    out = tmp_path / "d.parquet"
    p = run_cli("export", "--format", "parquet", "--store", str(store), "-o", str(out))
    assert p.returncode == 0
    t = pq.read_table(out).to_pylist()
    s = open_existing(str(store))
    recs = s.records()
    s.close()
    assert len(t) == len(recs) == 84
    for row, r in zip(t, recs):
        assert row["request_id"] == r.request_id and row["ttft"] == r.ttft and row["end_ns"] == r.end_ns
        assert row["event_offsets_ns"] == list(r.event_offsets_ns) and row["paired"] == r.paired
    assert pq.read_table(tmp_path / "d.steps.parquet").num_rows == 0  # this store predates steps
