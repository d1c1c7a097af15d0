"""The collector, fed through the official OpenTelemetry SDK exporters over real gRPC and HTTP."""

import json
from dataclasses import asdict

import pytest
from conftest import run_cli
from support.otlp_helpers import Req, grpc_exporter, http_exporter, metrics_text, records_by, send, wait_for

from otel_llm import semconv as sc
from otel_llm.metrics.slo import SLO

US = 1e-6  # float Unix seconds resolve about 0.2 us today: compare to the microsecond


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_both_boundaries_and_decomposition(make_collector, transport):
    c = make_collector()
    port = c.receivers[0].port if transport == "grpc" else c.receivers[1].address[1]
    exporter = grpc_exporter(port) if transport == "grpc" else http_exporter(port)
    send(exporter, [Req("fig1")])
    recs = records_by(c, 2)
    cl, en = recs[("client", "fig1")], recs[("engine", "fig1")]
    # client boundary: spec figure 1
    assert (
        cl.ttft == pytest.approx(0.100, abs=US)
        and cl.tpot == pytest.approx(0.035, abs=US)
        and cl.e2e == pytest.approx(0.180, abs=US)
    )
    assert cl.itl_max == pytest.approx(0.040, abs=US) and cl.output_tokens == 3
    # engine boundary: arrival 10 ms, first output handed out 85 ms
    assert en.ttft == pytest.approx(0.075, abs=US) and en.e2e == pytest.approx(0.150, abs=US)
    assert en.queue == pytest.approx(0.020, abs=US) and en.prefill == pytest.approx(0.050, abs=US)
    assert en.engine_delivery == pytest.approx(0.005, abs=US)
    # client TTFT = to_engine + queue + prefill + delivery, exactly (no HTTP server span here)
    assert (cl.to_engine, cl.queue, cl.prefill, cl.delivery) == pytest.approx((0.010, 0.020, 0.050, 0.020), abs=US)
    assert cl.to_engine + cl.queue + cl.prefill + cl.delivery == pytest.approx(cl.ttft, abs=1e-9)
    assert cl.paired and en.paired and cl.model == "tiny"
    assert cl.service == en.service == "test"  # the resource's service.name, carried into the record
    assert en.ttft <= cl.ttft


def test_one_boundary_preemptions_and_statuses(make_collector):
    c = make_collector()
    send(
        grpc_exporter(c.receivers[0].port),
        [
            Req(
                "engine-only",
                client=False,
                preemptions=[(120, 140), (141, 150)],
                engine_events=[(85, 1), (115, 1), (155, 2)],
            ),
            Req("client-only", engine=False),
            Req(
                "cut",
                status="cancelled",
                client_events=[(100, 1)],
                client_end=120,
                engine_events=[(85, 1)],
                engine_end=110,
            ),
        ],
    )
    recs = records_by(c, 4)
    e = recs[("engine", "engine-only")]
    assert e.preemptions == 2 and e.preemption_time == pytest.approx(0.029, abs=US)
    assert e.output_tokens == 4 and e.tpot == pytest.approx(0.070 / 3, abs=US)
    assert not e.paired and ("client", "engine-only") not in recs
    assert recs[("client", "client-only")].to_engine is None and not recs[("client", "client-only")].paired
    assert recs[("client", "cut")].status == "cancelled" and recs[("engine", "cut")].status == "cancelled"
    assert recs[("client", "cut")].tpot is None  # N = 1: undefined, never 0


def test_analyze_store_windows_and_goodput(make_collector):
    """Figure 5 through the collector: 10 requests in a 10 s window, one slow first token, one
    slow TPOT -> 1 request/s, goodput 0.8/s, attainment 80%, at both boundaries."""
    c = make_collector()
    reqs = []
    for i in range(10):
        ttft, tpot = 500, 30
        if i == 3:
            ttft = 1500
        if i == 7:
            tpot = 70
        s = i * 500
        ev = [(s + ttft + j * tpot, 1) for j in range(5)]
        reqs.append(
            Req(
                f"r{i}",
                client_submit=s,
                client_events=ev,
                client_end=ev[-1][0] + 10,
                arrival=s + 1,
                first_scheduled=s + 2,
                first_generated=s + ttft - 2,
                engine_events=[(t - 1, k) for t, k in ev],
                engine_end=ev[-1][0] + 5,
            )
        )
    base = send(http_exporter(c.receivers[1].address[1]), reqs)
    wait_for(lambda: c.store.count() >= 20, what="20 records")
    c.stop()
    w0 = base / 1e9
    for boundary in ("client", "engine"):
        out = json.loads(
            run_cli(
                "analyze",
                "--store",
                c.config.store,
                "--boundary",
                boundary,
                "--format",
                "json",
                "--window",
                f"{w0!r},{w0 + 10!r}",
                "--slo",
                "ttft=1,tpot=0.05",
            ).stdout
        )
        assert out["counts"]["completed"] == 10
        assert out["throughput"]["requests_per_s"] == pytest.approx(1.0, abs=US)
        assert out["goodput"]["good"] == 8
        assert out["goodput"]["requests_per_s"] == pytest.approx(0.8, abs=US)
        assert out["goodput"]["attainment"] == pytest.approx(0.8, abs=US)
        assert out["latency"]["ttft"]["max"] == pytest.approx(1.5 if boundary == "client" else 1.498, abs=US)
    # the file form and the store form agree on the same data
    proc = run_cli("analyze", "--store", c.config.store, "--boundary", "client", check=False)
    assert proc.returncode == 0 and "completed 10" in proc.stdout


def test_prometheus_metrics_and_slo_counter(make_collector):

    c = make_collector(slos={"default": SLO(ttft=0.16), "strict": SLO(ttft=0.05)})
    send(
        grpc_exporter(c.receivers[0].port),
        [Req(f"m{i}", client_events=[(100 + 50 * (i % 2), 1), (170, 1)]) for i in range(4)],
    )
    wait_for(lambda: c.records_derived >= 8, what="derivation")
    text = metrics_text(c)
    assert "# TYPE gen_ai_server_time_to_first_token_seconds histogram" in text
    assert 'gen_ai_server_time_to_first_token_seconds_bucket{boundary="client",model="tiny",le="0.1"} 2' in text
    assert 'gen_ai_server_time_to_first_token_seconds_bucket{boundary="client",model="tiny",le="+Inf"} 4' in text
    assert 'gen_ai_server_time_to_first_token_seconds_count{boundary="engine",model="tiny"} 4' in text
    assert 'llm_slo_good_requests_total{boundary="client",model="tiny",slo="default"} 4' in text
    assert 'llm_slo_good_requests_total{boundary="client",model="tiny",slo="strict"} 0' in text
    assert 'llm_requests_total{boundary="client",model="tiny",status="ok"} 4' in text
    assert "gen_ai_server_time_per_output_token_seconds_bucket" in text
    assert "llm_inter_token_latency_seconds_count" in text and "llm_queue_duration_seconds_count" in text
    assert "# TYPE otel_llm_collector_receiver_spans_total counter" in text  # Prometheus naming: counters
    assert "# TYPE otel_llm_collector_assembly_traces_in_flight gauge" in text  # a level stays a gauge
    for bound in ("assembly_traces_limit", "derivation_backlog_limit", "receiver_http_connections_limit"):
        assert f"# TYPE otel_llm_collector_{bound} gauge" in text  # every buffer's bound beside its level


def test_the_collectors_levels_are_gauges_and_its_counts_counters(make_collector):
    """Each of the collector's own figures is declared once, where it is produced: counts (ever
    growing: Prometheus counters) apart from levels and bounds (gauges), never both."""
    from collector.exporters.prometheus import render

    c = make_collector()
    counts, levels = c.self_counters(), c.self_levels()
    assert counts and levels and not set(counts) & set(levels)
    text = render([], counts, None, levels)
    for key in levels:
        assert f"# TYPE otel_llm_collector_{key} gauge" in text, key
    for key in counts:
        assert f"# TYPE otel_llm_collector_{key}_total counter" in text, key


def test_the_fluidity_index_as_metrics(make_collector):
    """--fluidity ttft=0.12,tbt=0.05: a first token at 100 ms is on time (20 ms banked, spent by the
    70 ms gap); one at 150 ms misses 1 + floor(30 / 50) = 1 deadline, the next is on time: index 0.5."""

    from otel_llm.metrics.fluidity import FluidityTarget

    c = make_collector(fluidity=FluidityTarget(0.12, 0.05, target=0.9))
    send(
        grpc_exporter(c.receivers[0].port),
        [Req(f"f{i}", client_events=[(100 + 50 * (i % 2), 1), (170, 1)]) for i in range(4)],
    )
    wait_for(lambda: c.records_derived >= 8, what="derivation")
    text = metrics_text(c)
    assert "# TYPE llm_fluidity_index histogram" in text
    assert 'llm_fluidity_index_bucket{boundary="client",model="tiny",le="0.5"} 2' in text
    assert 'llm_fluidity_index_bucket{boundary="client",model="tiny",le="0.9"} 2' in text
    assert 'llm_fluidity_index_bucket{boundary="client",model="tiny",le="1.0"} 4' in text
    assert 'llm_fluidity_index_sum{boundary="client",model="tiny"} 3.0' in text
    assert 'llm_fluidity_fluid_requests_total{boundary="client",model="tiny"} 2' in text
    # without --fluidity, no such series
    plain = make_collector()
    send(grpc_exporter(plain.receivers[0].port), [Req("p0")])
    wait_for(lambda: plain.records_derived >= 2, what="derivation")
    assert "llm_fluidity" not in metrics_text(plain)


def test_tokens_a_client_that_gave_up_never_received(make_collector):
    """A client that left after 2 of the engine's 5 tokens: 3 unread, on both of its records and in
    llm_tokens_unread_total; a request read to its end: none."""

    c = make_collector()
    left = Req(
        "left",
        status="cancelled",
        client_events=[(100, 1), (130, 1)],
        client_end=135,
        engine_events=[(85, 1), (115, 1), (125, 1), (140, 1), (150, 1)],
    )
    send(grpc_exporter(c.receivers[0].port), [left, Req("read")])
    wait_for(lambda: c.records_derived >= 4, what="derivation")
    recs = records_by(c, 4)
    assert recs[("client", "left")].tokens_unread == recs[("engine", "left")].tokens_unread == 3
    assert recs[("client", "read")].tokens_unread is None and recs[("engine", "read")].tokens_unread is None
    assert 'llm_tokens_unread_total{boundary="engine",model="tiny"} 3' in metrics_text(c)


def test_tokens_an_engine_made_after_the_abort(make_collector):
    """The engine's llm.usage.tokens_after_abort on an aborted request: its record's column and
    llm_tokens_after_abort_total; a value of the wrong type or sign is unknown, never counted."""
    c = make_collector()
    reqs = [
        Req("cut", status="cancelled", engine_attrs={sc.TOKENS_AFTER_ABORT: 2}),
        Req("cut2", status="cancelled", engine_attrs={sc.TOKENS_AFTER_ABORT: 0}),
        Req("odd", status="cancelled", engine_attrs={sc.TOKENS_AFTER_ABORT: -5}),
        Req("text", status="cancelled", engine_attrs={sc.TOKENS_AFTER_ABORT: "lots"}),
        Req("fine"),
    ]
    send(grpc_exporter(c.receivers[0].port), reqs)
    wait_for(lambda: c.records_derived >= 10, what="derivation")
    recs = records_by(c, 10)
    got = {rid: recs[("engine", rid)].tokens_after_abort for rid in ("cut", "cut2", "odd", "text", "fine")}
    assert got == {"cut": 2, "cut2": 0, "odd": None, "text": None, "fine": None}
    assert recs[("client", "cut")].tokens_after_abort is None  # the engine's count, on the engine's record
    assert 'llm_tokens_after_abort_total{boundary="engine",model="tiny"} 2' in metrics_text(c)


def test_store_survives_restart_and_appends(make_collector, tmp_path):
    from collector.pipeline.records import RecordBatch
    from collector.storage.store import RequestStore

    path = str(tmp_path / "persist.db")
    c1 = make_collector(store=path)
    send(grpc_exporter(c1.receivers[0].port), [Req("a"), Req("b")])
    wait_for(lambda: c1.store.count() >= 4)
    c1.stop()
    c2 = make_collector(store=path)
    send(grpc_exporter(c2.receivers[0].port), [Req("c")])
    wait_for(lambda: c2.store.count() >= 6)
    c2.stop()
    s = RequestStore(path)
    assert sorted({r.request_id for r in s.records()}) == ["a", "b", "c"]
    # the same records again are ignored, never stored twice
    again = RecordBatch.from_records(s.records())
    plain = lambda rs: [
        (
            asdict(r)
            | {
                "event_offsets_ns": list(map(int, r.event_offsets_ns)),
                "event_tokens": list(map(int, r.event_tokens)),
            }
        )
        for r in rs
    ]
    assert plain(again.records()) == plain(s.records())  # the batch form loses nothing
    assert s.add(again) == 0 and s.count() == 6
    s.close()


def test_forward_traces_unchanged(make_collector):
    target = make_collector()
    front = make_collector(forward_traces=f"grpc://127.0.0.1:{target.receivers[0].port}")
    send(http_exporter(front.receivers[1].address[1]), [Req("fwd")])
    wait_for(lambda: target.store.count() >= 2, what="forwarded records")
    wait_for(lambda: front.store.count() >= 2, what="the front collector's own records")  # it writes too
    a = {(r.boundary, r.request_id): r for r in front.store.records()}
    b = {(r.boundary, r.request_id): r for r in target.store.records()}
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].trace_id == b[k].trace_id and a[k].event_times == b[k].event_times
    assert target.receiver_counters.spans == front.receiver_counters.spans == 5  # client, engine, 3 phases


def test_otlp_metrics_push(make_collector):
    """--forward-metrics pushes the same histograms over OTLP/HTTP."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    got = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            req = ExportMetricsServiceRequest()
            req.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((self.path, req))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    c = make_collector(
        forward_metrics=f"http://127.0.0.1:{srv.server_address[1]}",
        metrics_interval_s=0.3,
        slos={"default": SLO(ttft=1)},
    )
    send(grpc_exporter(c.receivers[0].port), [Req("p1"), Req("p2")])
    wait_for(lambda: c.records_derived >= 4)

    def pushed_ttft():
        for path, req in got:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if (
                            m.name == "gen_ai.server.time_to_first_token"
                            and sum(p.count for p in m.histogram.data_points) == 4
                        ):
                            return path, m
        return None

    path, m = wait_for(pushed_ttft, what="pushed TTFT histogram")
    assert path == "/v1/metrics" and m.unit == "s"
    assert list(m.histogram.data_points[0].explicit_bounds)[:3] == [0.001, 0.005, 0.01]
    assert m.histogram.aggregation_temporality == 2  # cumulative
    srv.shutdown()


def test_the_forward_queue_is_bounded_in_bytes():
    """600 bodies of 100 KB for a target that is not draining them: the queue holds at most its
    byte bound (it held 600 x 1 MiB before: RSS 57 -> 661 MB), the rest is dropped and counted."""
    from collector.exporters.otlp_forward import OTLPForwarder as TraceForwarder

    f = TraceForwarder("http://127.0.0.1:9", max_queue_bytes=1 << 20)  # not started: nothing drains
    for _ in range(600):
        f.submit(b"x" * 100_000)
    assert f.queued_bytes == 10 * 100_000 and f.dropped == 590
    f.start()  # the target refuses: each send fails, is counted, and frees its bytes
    wait_for(lambda: f.failed == 10, what="the queued sends to fail")
    assert f.queued_bytes == 0
    f.stop()


def test_every_series_the_collector_gives_of_itself_is_declared_once(make_collector, tmp_path):
    """With every component on (store, spool, both forwarders, the forwarding policy), the
    collector's own counts and levels are exactly collector.health's COUNTS and LEVELS, each
    exposed with its declared help."""
    from collector.exporters.prometheus import render
    from collector.exporters.trace_policy import TracePolicy
    from collector.health import BY_KEY, COUNTS, LEVELS, exposed_name

    target = make_collector()
    grpc = f"grpc://127.0.0.1:{target.receivers[0].port}"
    c = make_collector(
        spool=str(tmp_path / "spool"),
        forward_traces=grpc,
        forward_traces_policy=TracePolicy.parse("error"),
        forward_records=grpc,
    )
    counts, levels = c.self_counters(), c.self_levels()
    assert set(counts) == {s.key for s in COUNTS}
    assert set(levels) == {s.key for s in LEVELS}
    text = render([], counts, None, levels)
    for key in (*counts, *levels):
        assert f"# HELP {exposed_name(key)} the collector's {BY_KEY[key].help}\n" in text, key
