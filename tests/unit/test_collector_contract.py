"""The OTLP receiver contract, bad input, overload, auth, and the assembly rules."""

import gzip
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
from conftest import ROOT
from google.rpc import error_details_pb2, status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceResponse,
)
from support.otlp_helpers import Req, free_port, sample_request

from collector.pipeline import walked_span as sp
from collector.pipeline.assembly import AssemblyConfig, AssemblyFull, TraceAssembler
from collector.pipeline.derive import derive
from collector.pipeline.walked_span import make_span
from collector.receivers.decode import DecodeError, decode_payload
from otel_llm import semconv as sc
from otel_llm.otlp.otlp_json import to_json

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def post(port, body, ctype="application/x-protobuf", headers=None):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/traces",
        data=body,
        method="POST",
        headers={"Content-Type": ctype, **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def raw_grpc(port, body: bytes, metadata=None):
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = ch.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
    try:
        return call.with_call(body, metadata=metadata, timeout=10)
    finally:
        ch.close()


# -- HTTP --------------------------------------------------------------------------------------


def test_http_success_protobuf_json_gzip(make_collector):
    c = make_collector()
    port = c.receivers[1].address[1]
    body = sample_request().SerializeToString()
    code, h, resp = post(port, body)
    assert code == 200 and h["Content-Type"] == "application/x-protobuf"
    r = ExportTraceServiceResponse()
    r.ParseFromString(resp)
    assert not r.HasField("partial_success")  # success without partial_success
    code, h, resp = post(
        port, gzip.compress(sample_request([Req("gz")]).SerializeToString()), headers={"Content-Encoding": "gzip"}
    )
    assert code == 200
    code, h, resp = post(port, to_json(sample_request([Req("js")])).encode(), "application/json")
    assert code == 200 and h["Content-Type"] == "application/json" and json.loads(resp) == {}
    assert c.receiver_counters.spans == 15


def test_http_malformed_and_unsupported(make_collector):
    c = make_collector()
    port = c.receivers[1].address[1]
    code, _, body = post(port, b"\xff\xfe not protobuf")
    st_ = status_pb2.Status()
    st_.ParseFromString(body)
    assert code == 400 and st_.code == 3 and "malformed" in st_.message
    code, _, body = post(port, b"{nope", "application/json")
    assert code == 400 and "malformed JSON" in json.loads(body)["message"]
    code, _, body = post(port, b"x", "text/plain")
    assert code == 415
    code, _, _ = post(port, b"\x1f\x8bbroken", headers={"Content-Encoding": "gzip"})
    assert code == 400
    assert c.receiver_counters.payloads_invalid == 3


def test_http_size_limit_including_gzip_bombs(make_collector):
    c = make_collector(max_message_bytes=64 * 1024)
    port = c.receivers[1].address[1]
    code, _, _ = post(port, b"\x00" * (65 * 1024))
    assert code == 413
    bomb = gzip.compress(b"\x00" * (10 * 2**20))  # 10 KiB that inflate to 10 MiB
    assert len(bomb) < 64 * 1024
    code, _, _ = post(port, bomb, headers={"Content-Encoding": "gzip"})
    assert code == 413


def test_partial_success_for_bad_spans(make_collector):
    c = make_collector()
    req = sample_request()
    bad = req.resource_spans[0].scope_spans[0].spans[0]
    bad.trace_id = b"\x00" * 16
    code, _, body = post(c.receivers[1].address[1], req.SerializeToString())
    r = ExportTraceServiceResponse()
    r.ParseFromString(body)
    assert code == 200 and r.partial_success.rejected_spans == 1 and "invalid" in r.partial_success.error_message


def test_bearer_token_on_both_receivers(make_collector):
    c = make_collector(auth_token="s3cret")
    body = sample_request().SerializeToString()
    port = c.receivers[1].address[1]
    assert post(port, body)[0] == 401
    assert post(port, body, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert post(port, body, headers={"Authorization": "Bearer s3cret"})[0] == 200
    with pytest.raises(grpc.RpcError) as e:
        raw_grpc(c.receivers[0].port, body)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _, call = raw_grpc(c.receivers[0].port, body, metadata=(("authorization", "Bearer s3cret"),))
    assert call.code() == grpc.StatusCode.OK


def test_overload_answers_retry_later(make_collector):
    c = make_collector(assembly=AssemblyConfig(grace_s=0.1, timeout_s=5, max_traces=2), max_backlog=3)
    c.pause()
    for i in range(6):  # each request is its own trace: the ring buffer evicts into the backlog
        post(c.receivers[1].address[1], sample_request([Req(f"o{i}")]).SerializeToString())
    code, h, _ = post(c.receivers[1].address[1], sample_request([Req("late")]).SerializeToString())
    assert code == 503 and h["Retry-After"] == "1"
    with pytest.raises(grpc.RpcError) as e:
        raw_grpc(c.receivers[0].port, sample_request([Req("g")]).SerializeToString())
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    details = dict(e.value.trailing_metadata())["grpc-status-details-bin"]
    st_ = status_pb2.Status()
    st_.ParseFromString(details)
    info = error_details_pb2.RetryInfo()
    st_.details[0].Unpack(info)
    assert info.retry_delay.seconds == 1
    c.resume()
    t0 = time.monotonic()
    while c.store.count() < 12 and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert c.store.count() == 12  # nothing that was accepted is lost
    assert c.receiver_counters.payloads_refused_overload == 2


# -- gRPC --------------------------------------------------------------------------------------


def test_grpc_malformed_is_invalid_argument(make_collector):
    c = make_collector()
    with pytest.raises(grpc.RpcError) as e:
        raw_grpc(c.receivers[0].port, b"\xff\xff\xff garbage")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in e.value.details()
    resp, call = raw_grpc(c.receivers[0].port, sample_request().SerializeToString())
    r = ExportTraceServiceResponse()
    r.ParseFromString(resp)
    assert call.code() == grpc.StatusCode.OK and not r.HasField("partial_success")


# -- fuzzing the decoders ------------------------------------------------------------------------

_VALID = sample_request([Req("f1", preemptions=[(120, 130)]), Req("f2", engine=False)]).SerializeToString()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes(data):
    for json_body in (False, True):
        try:
            decode_payload(data, json_body=json_body)
        except DecodeError:
            pass


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8),
    st.integers(0, len(_VALID)),
)
def test_fuzz_mutated_payloads(mutations, cut):
    data = bytearray(_VALID)
    for pos, val in mutations:
        data[pos] = val
    data = bytes(data[:cut] if cut % 3 == 0 else data)
    try:
        walked = decode_payload(data)
    except DecodeError:
        return
    # whatever decodes, the rest of the pipeline takes without crashing
    from collector.pipeline.assembly import ReleasedTrace
    from collector.pipeline.derive import derive

    batch, _ = derive([ReleasedTrace(s[sp.TRACE_ID], [s], "flush") for s in walked.spans])
    assert len(batch) <= len(walked.spans)
    batch.records()


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda ch: (
            st.lists(ch, max_size=4)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "resourceSpans",
                        "scopeSpans",
                        "spans",
                        "traceId",
                        "spanId",
                        "name",
                        "attributes",
                        "key",
                        "value",
                        "startTimeUnixNano",
                    ]
                ),
                ch,
                max_size=4,
            )
        ),
        max_leaves=20,
    )
)
def test_fuzz_json_structures(obj):
    try:
        decode_payload(json.dumps(obj).encode(), json_body=True)
    except DecodeError:
        pass


# -- assembly rules ------------------------------------------------------------------------------


def span(trace, sid, name=sc.SPAN_REQUEST, parent=""):
    return make_span(trace, sid, name, parent=parent, start=1, end=2, kind=2, request_id=trace)


def sids(rel):
    return {s[sp.SPAN_ID].hex() for s in rel.spans}


def test_assembly_grace_duplicates_late_out_of_order():
    a = TraceAssembler(AssemblyConfig(grace_s=1.0, timeout_s=10.0, max_traces=100))
    t = "a" * 32
    a.add([span(t, "02" * 8, sc.SPAN_QUEUE, "01" * 8)], now=0.0)  # a child before its parent: fine
    assert a.expire(5.0) == []  # no request span yet: waits for the timeout
    a.add([span(t, "01" * 8), span(t, "01" * 8)], now=5.0)  # duplicate in one batch
    assert a.counters.spans_duplicate == 1
    assert a.expire(5.9) == []
    (rel,) = a.expire(6.0)
    assert rel.reason == "grace" and sids(rel) == {"01" * 8, "02" * 8}
    a.add([span(t, "03" * 8, sc.SPAN_DECODE, "01" * 8)], now=7.0)  # late: counted, not re-derived
    assert a.counters.spans_late == 1 and len(a) == 0 and a.expire(100.0) == []


def test_engine_span_with_a_caller_waits_for_the_client_span():
    a = TraceAssembler(AssemblyConfig(grace_s=1.0, peer_wait_s=8.0, timeout_s=30.0))
    t, u = "c" * 32, "d" * 32
    # the engine's request span arrives first; its parent is the client span, exported later
    a.add([span(t, "0e" * 8, sc.SPAN_REQUEST, parent="0c" * 8)], now=0.0)
    assert a.expire(5.0) == []
    a.add([span(t, "0c" * 8, sc.SPAN_CLIENT_REQUEST)], now=6.0)  # the client's batch arrives 6 s later
    assert a.expire(6.9) == []
    (rel,) = a.expire(7.0)
    assert {sp.NAMES[s[sp.CODE]] for s in rel.spans} == {sc.SPAN_REQUEST, sc.SPAN_CLIENT_REQUEST}
    # a caller that never sends its span: released after peer_wait, the engine boundary alone
    a.add([span(u, "0e" * 8, sc.SPAN_REQUEST, parent="0a" * 8)], now=10.0)
    assert a.expire(17.9) == []
    assert [r.trace_id.hex() for r in a.expire(18.0)] == [u]


def test_a_cancelled_client_span_waits_for_its_engines_late_span():
    """An engine keeps an aborted request's span for its abort grace (1 s) before it sends it: a
    client span that says cancelled, exported at once, waits for it (up to peer_wait) and the two
    are released together, one request paired; one whose engine never comes is released after
    peer_wait; a client span that says ok is released after the grace, as before."""
    from collector.pipeline.derive import derive

    a = TraceAssembler(AssemblyConfig(grace_s=1.0, peer_wait_s=8.0, timeout_s=30.0))
    t, u, v = "c1" * 16, "d1" * 16, "e1" * 16
    gone = make_span(t, "0c" * 8, sc.SPAN_CLIENT_REQUEST, start=1, end=2, kind=3, request_id="r-c", status="cancelled")
    a.add([gone], now=0.0)
    assert a.expire(1.5) == []  # past the grace: its engine's span is still on its way
    engine = make_span(t, "0e" * 8, sc.SPAN_REQUEST, parent="0c" * 8, start=1, end=2, kind=2, request_id="r-c-0",
                       status="cancelled")  # fmt: skip
    a.add([engine], now=1.3)
    assert a.expire(2.2) == []
    (rel,) = a.expire(2.3)  # the grace after the engine's span
    batch, _ = derive([rel])
    assert batch.boundary == ["client", "engine"] and batch.paired.all()
    alone = make_span(u, "0c" * 8, sc.SPAN_CLIENT_REQUEST, start=1, end=2, kind=3, request_id="r-u", status="cancelled")
    a.add([alone], now=10.0)
    assert a.expire(17.9) == []
    assert [r.trace_id.hex() for r in a.expire(18.0)] == [u]
    done = make_span(v, "0c" * 8, sc.SPAN_CLIENT_REQUEST, start=1, end=2, kind=3, request_id="r-v", status="ok")
    a.add([done], now=20.0)
    assert [r.trace_id.hex() for r in a.expire(21.0)] == [v]


def test_assembly_timeout_and_ring_buffer_bound():
    a = TraceAssembler(AssemblyConfig(grace_s=1.0, timeout_s=3.0, max_traces=3))
    evicted = []
    for i in range(5):
        evicted += a.add([span(f"{i:032x}", "01" * 8, sc.SPAN_QUEUE, "02" * 8)], now=float(i))
    assert len(a) == 3 and [e.trace_id.hex() for e in evicted] == [f"{0:032x}", f"{1:032x}"]
    assert a.counters.traces_evicted == 2
    timed = a.expire(5.5)  # trace 2 arrived at t=2: its 3 s timeout passed
    assert [r.reason for r in timed] == ["timeout"] and timed[0].trace_id.hex() == f"{2:032x}"
    assert {r.trace_id.hex() for r in a.flush()} == {f"{3:032x}", f"{4:032x}"}


def test_sigterm_flushes_accepted_spans_to_the_store(tmp_path):
    store = tmp_path / "sig.db"
    gport, hport = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "otel_llm",
            "collector",
            "--otlp-grpc",
            f"127.0.0.1:{gport}",
            "--otlp-http",
            f"127.0.0.1:{hport}",
            "--prometheus",
            "off",
            "--store",
            str(store),
            "--trace-grace",
            "60",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "otel-llm collector:" in line and f"127.0.0.1:{hport}" in line
        code, _, _ = post(hport, sample_request([Req("x1"), Req("x2")]).SerializeToString())
        assert code == 200
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "4 stored" in err
    from collector.storage.store import RequestStore

    assert RequestStore(str(store)).count() == 4  # derived at shutdown, long before the 60 s grace


def test_a_late_span_of_a_boundary_not_derived_yet_is_derived():
    """The engine's spans reach the collector after the trace was released with the client span
    alone (evicted under load): they are derived as the engine's (unpaired) record, not dropped;
    a late span of a boundary already derived is still dropped."""
    a = TraceAssembler(AssemblyConfig(grace_s=1.0, timeout_s=10.0, max_traces=1))
    t, u = "e" * 32, "f" * 32
    a.add([span(t, "0c" * 8, sc.SPAN_CLIENT_REQUEST)], now=0.0)
    (ev,) = a.add([span(u, "0d" * 8, sc.SPAN_CLIENT_REQUEST)], now=0.1)  # t evicted, client only
    assert ev.reason == "evicted" and sids(ev) == {"0c" * 8}
    a.expire(5.0)  # u released by grace
    late = [span(t, "0e" * 8, sc.SPAN_REQUEST, parent="0c" * 8), span(t, "01" * 8, sc.SPAN_QUEUE, "0e" * 8)]
    a.add(late, now=6.0)
    a.add([span(t, "0c" * 8, sc.SPAN_CLIENT_REQUEST)], now=6.1)  # the client boundary again: dropped
    assert a.counters.spans_late_derived == 2 and a.counters.spans_late == 1
    (rel,) = a.expire(7.2)  # after the grace period (no wait for a client span already derived)
    assert sids(rel) == {"0e" * 8, "01" * 8}
    batch, _ = derive([ev, rel])
    recs = {(r.boundary, r.paired) for r in batch.records()}
    assert recs == {("client", False), ("engine", False)}
    a.add([span(t, "02" * 8, sc.SPAN_DECODE, "0e" * 8)], now=8.0)  # now the engine is derived too
    assert a.counters.spans_late == 2 and len(a) == 0


def test_when_full_refuse_applies_backpressure():
    """on_full="refuse": a request whose new traces do not fit is refused whole (the sender
    retries), nothing is evicted, and spans of traces already in flight are still taken."""
    a = TraceAssembler(AssemblyConfig(grace_s=1.0, timeout_s=10.0, max_traces=2, on_full="refuse"))
    a.add([span("1" * 32, "01" * 8), span("2" * 32, "02" * 8)], now=0.0)
    with pytest.raises(AssemblyFull):
        a.add([span("1" * 32, "03" * 8, sc.SPAN_QUEUE, "01" * 8), span("3" * 32, "04" * 8)], now=0.1)
    assert len(a) == 2 and a.counters.traces_evicted == 0 and a.counters.requests_refused_full == 1
    a.add([span("1" * 32, "03" * 8, sc.SPAN_QUEUE, "01" * 8)], now=0.2)  # an open trace: fits
    assert len(a.expire(1.5)) == 2
    a.add([span("3" * 32, "04" * 8)], now=1.6)  # room again
    assert len(a) == 1


def test_when_full_refuse_answers_503_and_loses_nothing(make_collector):
    """Through the service: with --when-full refuse, the 503s carry Retry-After and every
    acknowledged request is derived (no eviction)."""
    from collector.storage.store import RequestStore

    c = make_collector(assembly=AssemblyConfig(grace_s=0.3, timeout_s=5, max_traces=4, on_full="refuse"))
    port = c.receivers[1].address[1]
    c.pause()  # nothing is released meanwhile: the fifth trace does not fit
    codes = []
    for i in range(6):
        body = sample_request([Req(f"w{i}")]).SerializeToString()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/traces", data=body, headers={"Content-Type": "application/x-protobuf"}
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                codes.append(r.status)
        except urllib.error.HTTPError as exc:
            codes.append(exc.code)
            assert exc.headers["Retry-After"] == "1"
    assert codes[:4] == [200] * 4 and set(codes[4:]) == {503}
    c.resume()
    c.stop()
    assert c.assembler.counters.traces_evicted == 0
    stored = RequestStore(c.config.store)
    assert {r.request_id for r in stored.records()} == {f"w{i}" for i in range(4)}
    stored.close()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (root only: CI runs as root), unmounted after the test."""
    import os

    d = tmp_path / "small"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)]).returncode:
        pytest.skip("mounting a small filesystem needs root")
    yield d
    subprocess.run(["umount", "-l", str(d)])


def test_a_full_disk_refuses_new_data_and_loses_nothing_acknowledged(make_collector, small_disk):
    """The store's filesystem fills up: the collector answers 503 with Retry-After (not 200) from
    then on, keeps the records it could not write in memory, and writes them once there is room
    again; every request it acknowledged is in the store at the end."""
    import os

    from collector.storage.store import RequestStore

    c = make_collector(store=str(small_disk / "s.db"))
    c.store_writer.wait_ready(10)
    with open(small_disk / "ballast", "wb") as f:  # leave ~150 KB free
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        f.write(b"\0" * max(0, free - 150_000))
    port = c.receivers[1].address[1]
    acked, refused = [], 0
    for i in range(3000):
        body = sample_request([Req(f"d{i}")]).SerializeToString()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/traces", data=body, headers={"Content-Type": "application/x-protobuf"}
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                assert r.status == 200
                acked.append(f"d{i}")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503 and exc.headers["Retry-After"] == "1"
            assert b"store cannot write" in exc.read()
            refused += 1
            if refused >= 20:
                break
            time.sleep(0.05)
    assert refused >= 20 and len(acked) > 20
    print(f"full disk: {len(acked)} acknowledged, {refused} refused, {c.store_writer.unwritten_records} records kept")
    assert c.store_writer.failed_batches > 0 and c.store_writer.unwritten_records > 0
    os.remove(small_disk / "ballast")  # room again: the kept records are written, requests taken
    deadline = time.monotonic() + 20
    while (c.store_writer.error or c.store_writer.unwritten_records) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert c.store_writer.error is None
    c.stop()
    stored = RequestStore(c.config.store)
    ids = {r.request_id for r in stored.records()}
    stored.close()
    assert set(acked) <= ids and c.store_writer.records_lost == 0


def test_shutdown_is_bounded_even_when_the_store_cannot_write(make_collector, small_disk):
    """SIGTERM with the disk full: stop() returns within --shutdown-timeout, says how many records
    it could not write, and counts them; nothing hangs. Once the store has failed, new payloads are
    refused, so the sends stop at the first refusal."""
    import os

    c = make_collector(store=str(small_disk / "s.db"), shutdown_timeout_s=2.0)
    c.store_writer.wait_ready(10)
    with open(small_disk / "ballast", "wb") as f:
        f.write(b"\0" * (os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize))
    from collector.receivers.intake import Overloaded

    accepted = 0
    for i in range(40):  # a sender keeps going until the collector refuses (it may, mid-loop)
        try:
            c.accept(sample_request([Req(f"s{i}")]).SerializeToString())
        except Overloaded as exc:
            assert "store cannot write" in str(exc)
            break
        accepted += 1
    assert accepted > 0
    deadline = time.monotonic() + 10
    while c.store_writer.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.store_writer.error is not None
    t0 = time.monotonic()
    c.stop()
    assert time.monotonic() - t0 < 4.0
    assert c.store_writer.records_lost == c.records_derived > 0


def test_spans_per_trace_are_capped():
    a = TraceAssembler(AssemblyConfig(grace_s=1.0, timeout_s=10.0, max_spans_per_trace=3))
    t = "9" * 32
    a.add([span(t, f"{i:016x}", sc.SPAN_DECODE, "01" * 8) for i in range(1, 6)], now=0.0)
    assert a.counters.spans_over_trace_limit == 2 and len(a.flush()[0].spans) == 3


def test_json_bodies_are_decoded_a_few_at_a_time(make_collector):
    """--max-json-decodes: with the slots taken, a JSON body waits a second, then gets 503."""
    from collector.receivers.intake import Overloaded
    from otel_llm.otlp.otlp_json import to_json

    c = make_collector(max_json_decodes=1)
    body = to_json(sample_request([Req("j1")])).encode()
    c._json_slots.acquire()  # a decode in progress
    t0 = time.monotonic()
    with pytest.raises(Overloaded):
        c.accept(body, json_body=True)
    assert 0.9 < time.monotonic() - t0 < 3
    c._json_slots.release()
    assert c.accept(body, json_body=True).rejected == 0


def test_stop_is_once_whoever_calls_it(make_collector):
    """A stop after a stop returns at once (the gRPC receiver's loop is gone: it used to wait 12 s
    and raise), and stops racing each other (a signal handler and the main thread) end together,
    after everything acknowledged is stored."""
    import threading

    c = make_collector()
    body = sample_request([Req("once")]).SerializeToString()
    assert c.accept(body).rejected == 0
    done = []
    racers = [threading.Thread(target=lambda: (c.stop(), done.append(time.monotonic()))) for _ in range(3)]
    for t in racers:
        t.start()
    for t in racers:
        t.join(30)
    assert len(done) == 3
    from collector.storage.store import open_existing

    s = open_existing(c.config.store)
    assert {r.request_id for r in s.records()} == {"once"}
    s.close()
    t0 = time.monotonic()
    c.stop()
    assert time.monotonic() - t0 < 0.5
