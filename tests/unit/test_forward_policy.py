"""--forward-traces-policy: only the traces a rule keeps reach the next collector, each whole;
the front collector's own records and metrics keep every span. The rules, the deterministic
ratio, verdicts that come before or after the spans, held bytes that overflow, and a collector
forwarding to another one end to end."""

from __future__ import annotations

import time

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from support.otlp_helpers import Req, grpc_exporter, http_exporter, send, wait_for

from collector.config import CollectorConfig
from collector.exporters.trace_policy import PolicyForwarder, TracePolicy
from otel_llm.metrics.slo import SLO


def test_rules_parse_and_the_ratio_is_the_trace_id_rule():
    p = TracePolicy.parse("error, slo,stall,ratio=0.25")
    assert (p.error, p.slo, p.stall, p.ratio, p.all) == (True, True, True, 0.25, False)
    assert p.describe() == "error,slo,stall,ratio=0.25"
    assert TracePolicy.parse("all").all
    for bad in ("", "errors", "ratio", "ratio=2", "ratio=x", "slo=1"):
        with pytest.raises(ValueError):
            TracePolicy.parse(bad)
    low, high = bytes(8) + (2**62 - 1).to_bytes(8, "big"), bytes(8) + (2**62).to_bytes(8, "big")
    assert p.by_ratio(low) and not p.by_ratio(high)  # below / above 0.25 x 2^64
    assert CollectorConfig().forward_traces_policy is None


class Sink:
    def __init__(self):
        self.requests: list[ExportTraceServiceRequest] = []

    def submit(self, body: bytes) -> None:
        r = ExportTraceServiceRequest()
        r.ParseFromString(body)
        self.requests.append(r)

    def spans(self) -> dict[bytes, list[str]]:
        out: dict[bytes, list[str]] = {}
        for r in self.requests:
            for rs in r.resource_spans:
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.setdefault(s.trace_id, []).append(s.name)
        return out


def body(*spans: tuple[bytes, str]) -> bytes:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = "test"
    ss = rs.scope_spans.add()
    for tid, name in spans:
        s = ss.spans.add()
        s.trace_id, s.span_id, s.name = tid, b"\x01" * 8, name
    return req.SerializeToString()


def drain(pf: PolicyForwarder) -> None:
    deadline = time.monotonic() + 5
    while not pf._q.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)


def test_held_spans_follow_their_verdict_whole_early_or_late():
    sink = Sink()
    pf = PolicyForwarder(TracePolicy(error=True), sink, max_held_bytes=10_000).start()
    a, b, c = b"\xaa" * 16, b"\xbb" * 16, b"\xcc" * 16
    pf.submit(body((a, "llm.client.request"), (b, "llm.client.request")))
    pf.submit(body((a, "llm.request"), (b, "llm.request")))
    drain(pf)
    pf.verdicts({a: True, b: False})  # a kept: both its spans at once; b dropped
    assert sink.spans() == {a: ["llm.client.request", "llm.request"]}
    assert len(sink.requests) == 1  # one export request per trace
    pf.submit(body((a, "llm.queue"), (b, "llm.queue")))  # late spans follow their trace's verdict
    pf.verdicts({c: True})  # a verdict before its spans arrived
    pf.submit(body((c, "llm.client.request")))
    drain(pf)
    assert sink.spans() == {a: ["llm.client.request", "llm.request", "llm.queue"], c: ["llm.client.request"]}
    assert (pf.traces_forwarded, pf.traces_dropped) == (1, 1)
    pf.stop()


def test_a_trace_with_no_verdict_and_overflowing_bytes_are_decided_by_the_ratio():
    sink = Sink()
    never = TracePolicy(error=True, ratio=0.0)
    pf = PolicyForwarder(never, sink, max_held_bytes=200, hold_s=60).start()
    for i in range(20):
        pf.submit(body((bytes([i]) * 16, "llm.client.request")))
    drain(pf)
    assert pf.held_bytes <= 200 and pf.decided_early > 0 and not sink.requests  # ratio 0: let go
    pf.expire(now=time.monotonic() + 61)  # the rest: held past hold_s
    assert pf.held_bytes == 0 and pf.traces_dropped == 20
    pf.stop()
    sink2 = Sink()
    pf2 = PolicyForwarder(TracePolicy(all=True), sink2).start()
    pf2.submit(body((b"\x01" * 16, "llm.engine.steps")))  # never derived (engine steps)
    drain(pf2)
    pf2.stop()  # stopping decides what is held: all keeps it
    assert list(sink2.spans()) == [b"\x01" * 16]


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_collector_forwards_only_what_the_policy_keeps(make_collector, transport):
    target = make_collector()
    policy = TracePolicy.parse("error,slo,ratio=0.25")
    front = make_collector(
        forward_traces=f"grpc://127.0.0.1:{target.receivers[0].port}",
        forward_traces_policy=policy,
        slos={"default": SLO(ttft=0.12)},
    )
    reqs = [Req("failed", status="error"), Req("slow", client_events=[(150, 1), (170, 1)])]
    reqs += [Req(f"fine{i}") for i in range(40)]  # first token at 100 ms: within the SLO
    port = front.receivers[0].port if transport == "grpc" else front.receivers[1].address[1]
    send(grpc_exporter(port) if transport == "grpc" else http_exporter(port), reqs)
    wait_for(lambda: front.records_derived >= 84, what="the front collector's records")
    front.store_writer.drain()  # derived records reach the store through its writer process
    mine = {(r.boundary, r.request_id): r.trace_id for r in front.store.records()}
    assert len(mine) == 84  # the front keeps every request, forwarded or not
    trace_of = {rid: t for (b, rid), t in mine.items() if b == "client"}
    want = {trace_of["failed"], trace_of["slow"]}
    want |= {t for rid, t in trace_of.items() if rid.startswith("fine") and policy.by_ratio(bytes.fromhex(t))}
    assert 2 < len(want) < 42  # some of the fine ones, not all
    wait_for(lambda: target.store.count() >= 2 * len(want), what="the forwarded traces")
    time.sleep(0.5)
    got = {r.trace_id for r in target.store.records()}
    assert got == want
    assert target.receiver_counters.spans == 5 * len(want)  # whole: client, engine and its three phases
    assert front.registry.requests.series[("client", "tiny", "ok")] == 41  # metrics: every span
