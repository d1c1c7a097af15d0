"""Emitting request traces through the official OpenTelemetry SDK, and building export requests by hand
at the wire level, for collector tests; what the collector derives from them (:func:`records`)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, set_span_in_context

from collector.pipeline.assembly import AssemblyConfig, TraceAssembler
from collector.pipeline.derive import derive
from collector.receivers.decode import decode_payload, parse_request, walk_message
from engine_hooks.tiny_model import free_port  # noqa: F401 (the helpers' users import it from here)
from otel_llm import semconv as sc

MS = 1_000_000


@dataclass
class Req:
    """One request at both boundaries, times in ms after ``base``."""

    id: str
    client_submit: float = 0
    client_events: list = field(default_factory=lambda: [(100, 1), (130, 1), (170, 1)])
    client_end: float = 180
    status: str = "ok"
    engine: bool = True
    arrival: float = 10
    first_scheduled: float = 30
    first_generated: float = 80
    engine_events: list = field(default_factory=lambda: [(85, 1), (115, 1), (155, 1)])
    engine_end: float = 160
    preemptions: list = field(default_factory=list)  # [(start_ms, end_ms)]
    client: bool = True
    model: str = "tiny"
    client_attrs: dict = field(default_factory=dict)  # more attributes of the client span (bench run id...)
    generated: list | None = None  # ms: when the engine core generated each engine event's tokens
    server_received: float | None = None  # ms: an HTTP server span between client and engine from here
    server_chunks: list = field(default_factory=list)  # ms: the body chunks that server span wrote
    engine_attrs: dict = field(default_factory=dict)  # more attributes of the engine's request span


def provider(exporter, service="test") -> TracerProvider:
    tp = TracerProvider(resource=Resource.create({"service.name": service}))
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    return tp


def emit(tracer, r: Req, base_ns: int) -> None:
    t = lambda ms: base_ns + int(ms * MS)
    ctx = None
    client_span = None
    if r.client:
        offs = [int(e * MS) - int(r.client_submit * MS) for e, _ in r.client_events]
        client_span = tracer.start_span(
            sc.SPAN_CLIENT_REQUEST,
            kind=SpanKind.CLIENT,
            start_time=t(r.client_submit),
            attributes={
                sc.BOUNDARY: "client",
                sc.REQUEST_ID: r.id,
                sc.STATUS: r.status,
                sc.REQUEST_MODEL: r.model,
                sc.TOKEN_EVENT_OFFSETS: offs,
                sc.TOKEN_EVENT_TOKENS: [k for _, k in r.client_events],
                sc.OUTPUT_TOKENS: sum(k for _, k in r.client_events),
                **r.client_attrs,
            },
        )
        ctx = set_span_in_context(client_span)
    if r.server_received is not None:
        t0 = t(r.server_received)
        srv = tracer.start_span(
            "POST /v1/completions",
            context=ctx,
            kind=SpanKind.SERVER,
            start_time=t0,
            attributes={
                sc.BOUNDARY: "server",
                sc.HTTP_METHOD: "POST",
                sc.URL_PATH: "/v1/completions",
                sc.HTTP_CHUNK_OFFSETS: [t(c) - t0 for c in r.server_chunks],
            },
        )
        ctx = set_span_in_context(srv)
    if r.engine:
        offs = [int(e * MS) - int(r.arrival * MS) for e, _ in r.engine_events]
        gen = {} if r.generated is None else {sc.TOKEN_GENERATED_OFFSETS: [t(g) - t(r.arrival) for g in r.generated]}
        es = tracer.start_span(
            sc.SPAN_REQUEST,
            context=ctx,
            kind=SpanKind.SERVER,
            start_time=t(r.arrival),
            attributes={
                sc.BOUNDARY: "engine",
                sc.REQUEST_ID: r.id,
                sc.STATUS: r.status,
                sc.REQUEST_MODEL: r.model,
                sc.TOKEN_EVENT_OFFSETS: offs,
                sc.TOKEN_EVENT_TOKENS: [k for _, k in r.engine_events],
                sc.OUTPUT_TOKENS: sum(k for _, k in r.engine_events),
                **gen,
                **r.engine_attrs,
            },
        )
        ectx = set_span_in_context(es)
        phases = [
            (sc.SPAN_QUEUE, r.arrival, r.first_scheduled),
            (sc.SPAN_PREFILL, r.first_scheduled, r.first_generated),
        ]
        if r.engine_events:
            phases.append((sc.SPAN_DECODE, r.first_generated, r.engine_events[-1][0] - 5))
        for p0, p1 in r.preemptions:
            phases.append((sc.SPAN_PREEMPTION, p0, p1))
        for name, a, b in phases:
            c = tracer.start_span(
                name,
                context=ectx,
                start_time=t(a),
                attributes={
                    sc.BOUNDARY: "engine",
                    **({sc.PREEMPTION_MODE: "recompute"} if name == sc.SPAN_PREEMPTION else {}),
                },
            )
            c.end(end_time=t(b))
        es.end(end_time=t(r.engine_end))
    if r.server_received is not None:
        srv.end(end_time=t(max([r.engine_end, *r.server_chunks])))
    if client_span is not None:
        client_span.end(end_time=t(r.client_end))


def grpc_exporter(port: int, **kw):
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, **kw)


def http_exporter(port: int, **kw):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", **kw)


def sample_request(reqs=None) -> ExportTraceServiceRequest:
    """A real export request, as the SDK's encoder builds it."""
    import time

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    mem = InMemorySpanExporter()
    tp = provider(mem)
    for r in reqs or [Req("s1")]:
        emit(tp.get_tracer("t"), r, time.time_ns())
    tp.shutdown()
    return encode_spans(mem.get_finished_spans())


# -- spans shaped by hand at the wire level, and what the collector derives from them -------------


def _kv(key: str, v) -> KeyValue:
    if isinstance(v, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=v))
    if isinstance(v, int):
        return KeyValue(key=key, value=AnyValue(int_value=v))
    if isinstance(v, float):
        return KeyValue(key=key, value=AnyValue(double_value=v))
    if isinstance(v, list):
        return KeyValue(key=key, value=AnyValue(array_value={"values": [AnyValue(int_value=x) for x in v]}))
    return KeyValue(key=key, value=AnyValue(string_value=v))


def span(trace: int, sid: int, name: str, start_ns: int, end_ns: int, attrs: dict, parent: int = 0, kind=2) -> Span:
    return Span(
        trace_id=trace.to_bytes(16, "big"),
        span_id=sid.to_bytes(8, "big"),
        parent_span_id=parent.to_bytes(8, "big") if parent else b"",
        name=name,
        kind=kind,
        start_time_unix_nano=start_ns,
        end_time_unix_nano=end_ns,
        attributes=[_kv(k, v) for k, v in attrs.items()],
    )


def body(*spans: Span, service="vllm.llm_engine") -> bytes:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(_kv("service.name", service))
    rs.scope_spans.add().spans.extend(spans)
    return req.SerializeToString()


def records(*bodies: bytes, walker: str = "c"):
    asm = TraceAssembler(AssemblyConfig(max_traces=10**6, max_spans_per_trace=10**6))
    for b in bodies:
        w = decode_payload(b) if walker == "c" else walk_message(parse_request(b, False))
        asm.add(w.spans, 0.0)
    batch, rm = derive(asm.flush())
    return batch, rm


# -- a running collector, fed through the SDK ------------------------------------------------------


def wait_for(pred, timeout=10.0, what="condition"):
    """``pred()`` once it is truthy, polled every 50 ms for ``timeout`` seconds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def send(exporter, reqs, base_ns=None):
    """Emit ``reqs`` through the SDK to ``exporter`` and flush; returns the base time (Unix ns)."""
    base_ns = base_ns or time.time_ns()
    tp = provider(exporter)
    tracer = tp.get_tracer("test")
    for r in reqs:
        emit(tracer, r, base_ns)
    tp.shutdown()
    return base_ns


def metrics_text(c) -> str:
    """The collector's Prometheus scrape."""
    import urllib.request

    host, port = c.prometheus.address
    return urllib.request.urlopen(f"http://{host}:{port}/metrics").read().decode()


def store_records(path: str) -> list:
    """Every record of the store at ``path``, client, server and engine in that order."""
    from collector.storage.store import RequestStore

    s = RequestStore(path)
    try:
        return [r for b in ("client", "server", "engine") for r in s.batch(b).records()]
    finally:
        s.close()


def records_by(c, n, boundary=None):
    wait_for(lambda: c.store.count(boundary) >= n, what=f"{n} records")
    return {(r.boundary, r.request_id): r for r in c.store.records(boundary)}


def metrics_body(metrics: list[tuple[str, str, float]], service: str = "svc", pid: int = 7) -> bytes:
    """An OTLP metrics export from one traced process (``process.pid``), each metric a sum or a gauge
    of one point on the ``vllm/engine`` pipeline."""
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    for k, v in (("service.name", service), ("process.pid", pid)):
        a = rm.resource.attributes.add(key=k)
        if isinstance(v, int):
            a.value.int_value = v
        else:
            a.value.string_value = v
    sm = rm.scope_metrics.add()
    for name, kind, v in metrics:
        m = sm.metrics.add(name=name, unit="s")
        pts = m.sum.data_points if kind == "sum" else m.gauge.data_points
        if kind == "sum":
            m.sum.is_monotonic = True
            m.sum.aggregation_temporality = 2  # cumulative
        p = pts.add(as_double=v)
        p.attributes.add(key="otel_llm.pipeline").value.string_value = "vllm/engine"
    return req.SerializeToString()


def post_metrics(c, body: bytes, ctype: str = "application/x-protobuf", **headers) -> tuple[int, bytes]:
    """POST an OTLP metrics body to collector ``c``'s /v1/metrics: (status, response body)."""
    url = f"http://127.0.0.1:{c.receivers[1].address[1]}/v1/metrics"
    r = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": ctype, **headers})
    try:
        with urllib.request.urlopen(r, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def pd_bodies(k: int, base_ns: int, model: str = "tiny") -> list[bytes]:
    """One disaggregated request at the wire level, as the senders export it (times in ms after
    ``base_ns``): the client; the proxy's server span; the prefill engine's leg (its server span,
    llm.request with role prefill, queue, prefill); the decode engine's (the same, role decode,
    naming the prefill leg); and the engine cores' accounts of the request's KV fetch, the prefill
    engine's hold and the NIXL worker's transfer, each a trace of its own."""
    t = lambda ms: base_ns + int(ms * MS)
    tr, ids = 0x9D00 + k, iter(range(k * 100 + 1, k * 100 + 100))
    client, proxy, ps, pe, ds, de = (next(ids) for _ in range(6))
    e = {sc.BOUNDARY: "engine", sc.REQUEST_MODEL: model, sc.PD_CONNECTOR: "NixlConnector"}
    evs = lambda *ms: {sc.TOKEN_EVENT_OFFSETS: [int(m * MS) for m in ms], sc.TOKEN_EVENT_TOKENS: [1] * len(ms)}
    rid, p_id, d_id = f"cmpl-pd{k}", f"cmpl-pd{k}-p", f"cmpl-pd{k}-d"
    traced = [
        span(tr, client, sc.SPAN_CLIENT_REQUEST, t(0), t(90), {
            sc.BOUNDARY: "client", sc.REQUEST_ID: rid, sc.STATUS: "ok", sc.REQUEST_MODEL: model,
            sc.OUTPUT_TOKENS: 3, **evs(62, 70, 80)}, kind=3),
        span(tr, proxy, "POST /v1/completions", t(1), t(89), {sc.BOUNDARY: "server"}, parent=client),
        span(tr, ps, "POST /v1/completions", t(2), t(20), {sc.BOUNDARY: "server"}, parent=proxy),
        span(tr, pe, sc.SPAN_REQUEST, t(3), t(19), {
            **e, sc.REQUEST_ID: rid, sc.STATUS: "ok", sc.REQUEST_INTERNAL_ID: p_id, sc.PD_ROLE: "prefill",
            sc.PD_ENGINE_ID: "engine-P", sc.OUTPUT_TOKENS: 1, **evs(15)}, parent=ps),
        span(tr, next(ids), sc.SPAN_QUEUE, t(4), t(6), {sc.BOUNDARY: "engine"}, parent=pe),
        span(tr, next(ids), sc.SPAN_PREFILL, t(6), t(17), {sc.BOUNDARY: "engine"}, parent=pe),
        span(tr, ds, "POST /v1/completions", t(30), t(88), {
            sc.BOUNDARY: "server", sc.HTTP_CHUNK_OFFSETS: [int(m * MS) for m in (31, 39, 49)]}, parent=proxy),
        span(tr, de, sc.SPAN_REQUEST, t(31), t(87), {
            **e, sc.REQUEST_ID: rid, sc.STATUS: "ok", sc.REQUEST_INTERNAL_ID: d_id, sc.PD_ROLE: "decode",
            sc.PD_ENGINE_ID: "engine-D", sc.PD_PEER_REQUEST_ID: p_id, sc.PD_PEER_ENGINE_ID: "engine-P",
            sc.OUTPUT_TOKENS: 3, **evs(29, 37, 47)}, parent=ds),
        span(tr, next(ids), sc.SPAN_QUEUE, t(32), t(55), {sc.BOUNDARY: "engine"}, parent=de),
        span(tr, next(ids), sc.SPAN_PREFILL, t(55), t(60), {sc.BOUNDARY: "engine"}, parent=de),
        span(tr, next(ids), sc.SPAN_DECODE, t(60), t(78), {sc.BOUNDARY: "engine"}, parent=de),
    ]  # fmt: skip
    own = lambda n: tr * 1000 + n  # the accounts' traces
    accounts = [
        span(own(1), next(ids), sc.SPAN_ENGINE_KV_TRANSFER, t(32), t(55), {
            sc.BOUNDARY: "engine", sc.REQUEST_INTERNAL_ID: d_id, sc.KV_LOAD_OFFSET: 3 * MS,
            sc.KV_RECEIVED_OFFSET: 18 * MS, sc.KV_BLOCKS: 1}),
        span(own(2), next(ids), sc.SPAN_ENGINE_KV_HOLD, t(19), t(48), {
            sc.BOUNDARY: "engine", sc.REQUEST_INTERNAL_ID: p_id, sc.KV_BLOCKS: 1}),
        span(own(3), next(ids), sc.SPAN_ENGINE_KV_TRANSPORT, t(40), t(47), {
            sc.BOUNDARY: "engine", sc.REQUEST_INTERNAL_ID: d_id, sc.KV_BYTES: 65536, sc.KV_WIRE: 6 * MS}),
    ]  # fmt: skip
    return [body(*accounts), body(*traced)]  # the engine cores' accounts come first, as they do
