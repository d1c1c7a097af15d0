"""The collector's fast paths give the same answers as the plain ones: the C walk of protobuf
bytes against protobuf's parser + the Python walk (generated and mutated payloads), derivation's
general pairing path, and the store writer process (including its death)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from support.otlp_helpers import Req, sample_request
from support.walk_diff import differential, needs_ext, same

from collector.pipeline import walked_span as sp
from collector.pipeline.assembly import ReleasedTrace
from collector.pipeline.derive import derive
from collector.pipeline.walked_span import make_span
from collector.receivers import decode
from collector.receivers.decode import DecodeError, parse_request, walk_message
from otel_llm import semconv as sc

# -- generated requests ---------------------------------------------------------------------------

KEYS = [*sp.ATTRIBUTE_SLOTS, "other.key", "", "service.name"]
NAMES = [*sp.CODES, "llm.engine.step", "http.get", ""]

int64 = st.integers(-(2**63), 2**63 - 1)
scalar_value = st.one_of(
    st.builds(lambda x: AnyValue(string_value=x), st.text(max_size=6)),
    st.builds(lambda x: AnyValue(bool_value=x), st.booleans()),
    st.builds(lambda x: AnyValue(int_value=x), int64),
    st.builds(lambda x: AnyValue(double_value=x), st.floats(allow_nan=False)),
    st.builds(lambda x: AnyValue(bytes_value=x), st.binary(max_size=4)),
    st.just(AnyValue()),
)
int_array = st.builds(
    lambda xs: AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=x) for x in xs])), st.lists(int64, max_size=6)
)
mixed_array = st.builds(lambda xs: AnyValue(array_value=ArrayValue(values=xs)), st.lists(scalar_value, max_size=3))
kvlist = st.builds(
    lambda k: AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key=k, value=AnyValue(int_value=1))])),
    st.text(max_size=3),
)
any_value = st.one_of(scalar_value, int_array, mixed_array, kvlist)
attributes = st.lists(st.builds(lambda k, v: KeyValue(key=k, value=v), st.sampled_from(KEYS), any_value), max_size=6)
ids = st.one_of(st.binary(min_size=8, max_size=8), st.just(b""), st.just(bytes(8)), st.binary(max_size=17))


@st.composite
def spans(draw):
    tid = draw(st.one_of(st.binary(min_size=16, max_size=16), st.just(bytes(16)), st.binary(max_size=17)))
    start = draw(st.integers(0, 2**64 - 1))
    end = draw(st.one_of(st.integers(0, 2**64 - 1), st.just(start), st.just(start + 5)))
    return Span(
        trace_id=tid,
        span_id=draw(ids),
        parent_span_id=draw(ids),
        name=draw(st.sampled_from(NAMES)),
        kind=draw(st.integers(0, 5)),
        start_time_unix_nano=start,
        end_time_unix_nano=min(end, 2**64 - 1),
        attributes=draw(attributes),
        status=Status(code=draw(st.integers(0, 2))),
    )


@st.composite
def requests(draw):
    req = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(0, 3))):
        rs = req.resource_spans.add()
        rs.resource.attributes.extend(draw(attributes))
        for _ in range(draw(st.integers(0, 2))):
            rs.scope_spans.add().spans.extend(draw(st.lists(spans(), max_size=4)))
    return req


@needs_ext
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_c_walk_equals_protobuf_walk(req):
    body = req.SerializeToString()
    fast = decode.walk_bytes(body)
    assert fast is not None  # a well-formed payload is always walked in C
    assert same(fast, walk_message(parse_request(body)))
    derive([ReleasedTrace(s[sp.TRACE_ID], [s], "flush") for s in fast.spans])[0].records()  # and derivation takes it


_VALID = sample_request([Req("m1", preemptions=[(120, 130)]), Req("m2", engine=False)]).SerializeToString()


def _valid_body() -> bytes:
    return _VALID


@needs_ext
@settings(max_examples=600, deadline=None)
@given(st.data())
def test_c_walk_on_mutated_payloads(data):
    """Never a crash; where protobuf takes the payload, the C walk gives the same or defers."""
    body = bytearray(_valid_body())
    for _ in range(data.draw(st.integers(1, 8))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    body = bytes(body[:cut] if data.draw(st.booleans()) else body)
    fast = decode.walk_bytes(body)
    try:
        slow = walk_message(parse_request(body))
    except DecodeError:
        return  # the C walk may defer (None) or be lenient about fields it does not read
    assert fast is None or same(fast, slow)


@needs_ext
def test_c_walk_defers_what_protobuf_must_decide():
    """Cases where protobuf's own semantics matter go to protobuf: a group, a value given twice
    (merged by protobuf), invalid UTF-8 in a value the walk returns."""
    base = ExportTraceServiceRequest()
    s = (
        base.resource_spans.add()
        .scope_spans.add()
        .spans.add(
            trace_id=b"\1" * 16, span_id=b"\2" * 8, name=sc.SPAN_REQUEST, start_time_unix_nano=1, end_time_unix_nano=2
        )
    )
    s.attributes.add(key=sc.REQUEST_ID).value.string_value = "ok"
    good = base.SerializeToString()
    assert decode.walk_bytes(good) is not None
    assert decode.walk_bytes(good + b"\x0b\x0c") is None  # a group at the top level
    bad_utf8 = good.replace(b"ok", b"\xff\xfe")
    assert decode.walk_bytes(bad_utf8) is None
    with pytest.raises(DecodeError):
        decode.decode_payload(bad_utf8)


def test_pure_python_switch(monkeypatch):
    monkeypatch.setenv("OTEL_LLM_PURE_PYTHON", "1")
    assert not decode.accelerated()
    w = decode.decode_payload(_valid_body())
    req = parse_request(_valid_body())
    n = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
    assert w.body == _valid_body() and w.total == n == len(w.spans) == 7  # every one a request or phase span


@needs_ext
def test_accelerated_by_default(monkeypatch):
    monkeypatch.delenv("OTEL_LLM_PURE_PYTHON", raising=False)
    assert decode.accelerated()
    fast, slow = decode.decode_payload(_valid_body()), walk_message(parse_request(_valid_body()))
    assert same(fast, slow)


# -- derivation: the general pairing path ---------------------------------------------------------


def test_derive_pairs_by_request_id_and_ancestry():
    t = "cd" * 16
    ms = 1_000_000
    spans = [
        make_span(
            t, "c1" * 8, sc.SPAN_CLIENT_REQUEST, start=0, end=100 * ms, request_id="r1", offsets=[50 * ms], tokens=[1]
        ),
        make_span(
            t,
            "c2" * 8,
            sc.SPAN_CLIENT_REQUEST,
            start=200 * ms,
            end=300 * ms,
            request_id="r2",
            offsets=[60 * ms, 70 * ms],
            tokens=[1, 2],
        ),
        make_span(
            t,
            "e2" * 8,
            sc.SPAN_REQUEST,
            parent="77" * 8,
            start=205 * ms,
            end=290 * ms,
            request_id="r2",
            offsets=[50 * ms, 62 * ms],
            tokens=[1, 2],
        ),
        make_span(
            t,
            "e1" * 8,
            sc.SPAN_REQUEST,
            parent="c1" * 8,
            start=10 * ms,
            end=95 * ms,
            request_id="zz",
            offsets=[30 * ms],
            tokens=[1],
        ),
        make_span(t, "01" * 8, sc.SPAN_QUEUE, parent="e1" * 8, start=10 * ms, end=15 * ms),
        make_span(t, "02" * 8, sc.SPAN_PREFILL, parent="e1" * 8, start=15 * ms, end=35 * ms),
        make_span(t, "03" * 8, sc.SPAN_PREEMPTION, parent="e1" * 8, start=36 * ms, end=38 * ms),
    ]
    batch, _ = derive([ReleasedTrace(bytes.fromhex(t), spans, "grace")])
    recs = {(r.boundary, r.request_id): r for r in batch.records()}
    c1, c2 = recs[("client", "r1")], recs[("client", "r2")]
    # r1: by ancestry (its engine span has another request id)
    assert c1.to_engine == pytest.approx(0.010) and c1.queue == pytest.approx(0.005)
    assert c1.prefill == pytest.approx(0.020) and c1.preemptions == 1 and c1.preemption_time == pytest.approx(0.002)
    assert c1.delivery == pytest.approx(0.050 - 0.035)  # client first token - engine first generated
    assert c1.to_engine + c1.queue + c1.prefill + c1.delivery == pytest.approx(c1.ttft)
    # r2: by request id (no ancestry); no engine phases, so delivery runs from the engine's first output
    assert c2.to_engine == pytest.approx(0.005) and c2.queue is None
    assert c2.delivery == pytest.approx(0.060 - (0.005 + 0.050))
    assert recs[("engine", "r2")].output_tokens == 3 and c2.tpot == pytest.approx(0.010 / 2)


def test_derive_cleans_token_events():
    """Out-of-order events are sorted, zero-token chunks dropped, mismatched arrays unusable."""
    ms = 1_000_000
    spans = [
        make_span(
            "01" * 16,
            "0a" * 8,
            sc.SPAN_CLIENT_REQUEST,
            start=0,
            end=50 * ms,
            offsets=[30 * ms, 10 * ms, 20 * ms],
            tokens=[1, 2, 0],
        ),
        make_span("02" * 16, "0b" * 8, sc.SPAN_CLIENT_REQUEST, start=0, end=50 * ms, offsets=[1, 2], tokens=[1]),
        make_span("03" * 16, "0c" * 8, sc.SPAN_CLIENT_REQUEST, start=0, end=50 * ms, offsets=sp.INVALID, tokens=[1]),
    ]
    batch, _ = derive([ReleasedTrace(s[0], [s], "grace") for s in spans])
    a, b, c = batch.records()
    assert list(a.event_offsets_ns) == [10 * ms, 30 * ms] and list(a.event_tokens) == [2, 1]
    assert a.ttft == pytest.approx(0.010) and a.output_tokens == 3
    assert len(b.event_offsets_ns) == 0 and b.ttft is None and len(c.event_offsets_ns) == 0
    from collector.storage.store import decode_events, event_blobs

    offs, toks = event_blobs(batch)
    assert [len(o) for o in offs] == [16, 0, 0] and [len(k) for k in toks] == [16, 0, 0]
    counts, d_offs, d_toks = decode_events([bytes(o) for o in offs], [bytes(k) for k in toks])
    assert counts == [2, 0, 0] and d_offs.tolist() == [10 * ms, 30 * ms] and d_toks.tolist() == [2, 1]


# -- the store writer process ---------------------------------------------------------------------


def _batch(n: int, seed: int):
    rnd = np.random.default_rng(seed)
    ms = 1_000_000
    spans = [
        make_span(
            rnd.bytes(16),
            rnd.bytes(8),
            sc.SPAN_CLIENT_REQUEST,
            start=i * ms,
            end=(i + 50) * ms,
            request_id=f"q{seed}-{i}",
            offsets=[5 * ms, 9 * ms],
            tokens=[1, 1 + i % 2],
        )
        for i in range(n)
    ]
    return derive([ReleasedTrace(s[0], [s], "grace") for s in spans])[0]


def test_store_writer_process_stores_and_counts(tmp_path):
    from collector.storage.store import RequestStore
    from collector.storage.store_writer import StoreWriter

    path = str(tmp_path / "w.db")
    mine = RequestStore(path)
    w = StoreWriter(mine, max_pending=2)
    assert not w.in_process
    b = _batch(50, 1)
    for _ in range(3):
        w.put(b)  # the same records again: stored once
    w.put(_batch(7, 2))
    w.drain()
    assert (w.stored, w.duplicates, w.failed_batches) == (57, 100, 0)
    w.close()
    mine.close()
    s = RequestStore(path)
    got = {r.request_id: r for r in s.records()}
    assert len(got) == 57 and list(got["q1-3"].event_offsets_ns) == [5_000_000, 9_000_000]
    assert got["q1-3"].event_tokens == [1, 2] and got["q1-4"].event_tokens == [1, 1]  # stored as "all ones"
    assert got["q1-3"].ttft == pytest.approx(0.005) and got["q1-3"].tpot == pytest.approx(0.002)
    assert got["q1-4"].tpot == pytest.approx(0.004) and got["q1-3"].output_tokens == 3
    s.close()


def test_store_writer_survives_its_process_dying(tmp_path):
    from collector.storage.store import RequestStore
    from collector.storage.store_writer import StoreWriter

    path = str(tmp_path / "d.db")
    mine = RequestStore(path)
    w = StoreWriter(mine)
    w.put(_batch(5, 3))
    w.drain()
    os.kill(w.pid, signal.SIGKILL)
    w._proc.wait()
    for seed in (4, 5):  # the first put may still find the pipe open; either way nothing is lost after
        w.put(_batch(5, seed))
    w.drain()
    assert w.in_process and w.stored == 15 and w.failed_batches == 0
    w.close()
    mine.close()
    s = RequestStore(path)
    assert s.count() == 15
    s.close()


def test_histogram_buckets_agree_for_few_and_many_samples():
    """The two bucketing paths (binary search for a few values, one compare per bound for many)
    put every value in the same bucket: le = the first bound >= the value."""
    from collector.pipeline.metrics_registry import ITL_BUCKETS, Histogram

    rnd = np.random.default_rng(7)
    values = np.concatenate([rnd.uniform(0, 0.2, 20_000), np.array(ITL_BUCKETS), [0.0, 11.0, np.nan]])
    many, few = (Histogram("h", "s", "", ITL_BUCKETS, ("b",)) for _ in range(2))
    many.observe(("x",), values)
    for chunk in np.array_split(values, 400):  # 50 values at a time: the binary-search path
        few.observe(("x",), chunk)
    a, b = many.series[("x",)], few.series[("x",)]
    assert a.counts.tolist() == b.counts.tolist() and a.count == b.count == len(values) - 1
    expect = np.bincount(np.searchsorted(ITL_BUCKETS, values[:-1], side="left"), minlength=len(ITL_BUCKETS) + 1)
    assert a.counts.tolist() == expect.tolist()
    assert a.counts[ITL_BUCKETS.index(0.01)] >= 1  # a value equal to a bound is counted in that bucket


def test_derive_span_ids_shared_across_traces():
    """Span ids are unique within a trace only: two traces in one batch reusing the same ids
    each get their own phases and pairs; a client span claimed by two engine spans is
    resolved by the general matching (one to one)."""
    ms = 1_000_000

    def trace(t, queue_ms, rid):
        return [
            make_span(
                t,
                "c1" * 8,
                sc.SPAN_CLIENT_REQUEST,
                start=0,
                end=100 * ms,
                request_id=rid,
                offsets=[60 * ms],
                tokens=[1],
            ),
            make_span(
                t,
                "e1" * 8,
                sc.SPAN_REQUEST,
                parent="c1" * 8,
                start=2 * ms,
                end=90 * ms,
                request_id=rid,
                offsets=[50 * ms],
                tokens=[1],
            ),
            make_span(t, "01" * 8, sc.SPAN_QUEUE, parent="e1" * 8, start=2 * ms, end=(2 + queue_ms) * ms),
        ]

    a, b = trace("aa" * 16, 5, "ra"), trace("bb" * 16, 9, "rb")
    batch, _ = derive(
        [ReleasedTrace(bytes.fromhex("aa" * 16), a, "grace"), ReleasedTrace(bytes.fromhex("bb" * 16), b, "grace")]
    )
    recs = {(r.boundary, r.request_id): r for r in batch.records()}
    assert recs[("engine", "ra")].queue == pytest.approx(0.005) and recs[("engine", "rb")].queue == pytest.approx(0.009)
    assert recs[("client", "ra")].queue == pytest.approx(0.005) and recs[("client", "rb")].queue == pytest.approx(0.009)
    assert all(r.paired for r in recs.values())

    # two engine spans under one client span (a retry inside the server): one pair, the one with
    # the client's request id
    t = "cc" * 16
    spans = [
        make_span(
            t, "c1" * 8, sc.SPAN_CLIENT_REQUEST, start=0, end=100 * ms, request_id="r2", offsets=[60 * ms], tokens=[1]
        ),
        make_span(
            t, "e1" * 8, sc.SPAN_REQUEST, parent="c1" * 8, start=2 * ms, end=20 * ms, request_id="r1", status="error"
        ),
        make_span(
            t,
            "e2" * 8,
            sc.SPAN_REQUEST,
            parent="c1" * 8,
            start=25 * ms,
            end=90 * ms,
            request_id="r2",
            offsets=[30 * ms],
            tokens=[1],
        ),
    ]
    batch, _ = derive([ReleasedTrace(bytes.fromhex(t), spans, "grace")])
    recs = {(r.boundary, r.request_id): r for r in batch.records()}
    assert recs[("client", "r2")].paired and recs[("engine", "r1")].paired != recs[("engine", "r2")].paired
    assert recs[("engine", "r2")].paired and not recs[("engine", "r1")].paired
    assert recs[("client", "r2")].to_engine == pytest.approx(0.025)


def test_compare_uses_the_pairs_derivation_made(tmp_path):
    """Pairs made by ancestry between records with different request ids survive the store:
    compare pairs exactly what derivation paired (each record names its peer)."""
    from collector.analysis.compare import pairs_from_records
    from collector.storage.store import RequestStore

    ms = 1_000_000
    t = "ef" * 16
    spans = [
        make_span(
            t,
            "c1" * 8,
            sc.SPAN_CLIENT_REQUEST,
            start=0,
            end=100 * ms,
            request_id="client-a",
            offsets=[50 * ms],
            tokens=[1],
        ),
        make_span(
            t,
            "c2" * 8,
            sc.SPAN_CLIENT_REQUEST,
            start=0,
            end=100 * ms,
            request_id="client-b",
            offsets=[70 * ms],
            tokens=[1],
        ),
        make_span(
            t,
            "e2" * 8,
            sc.SPAN_REQUEST,
            parent="c2" * 8,
            start=3 * ms,
            end=90 * ms,
            request_id="engine-b",
            offsets=[60 * ms],
            tokens=[1],
        ),
        make_span(
            t,
            "e1" * 8,
            sc.SPAN_REQUEST,
            parent="c1" * 8,
            start=1 * ms,
            end=90 * ms,
            request_id="engine-a",
            offsets=[40 * ms],
            tokens=[1],
        ),
    ]
    batch, _ = derive([ReleasedTrace(bytes.fromhex(t), spans, "grace")])
    store = RequestStore(str(tmp_path / "p.db"))
    store.add(batch)
    pairs, alone = pairs_from_records(store.records())
    store.close()
    assert alone == [] and sorted((c.request_id, e.request_id) for c, e in pairs) == [
        ("client-a", "engine-a"),
        ("client-b", "engine-b"),
    ]
    assert {c.request_id: c.to_engine for c, _ in pairs} == pytest.approx({"client-a": 0.001, "client-b": 0.003})


def test_store_written_by_an_earlier_version_gains_new_columns(tmp_path):
    import sqlite3

    from collector.pipeline.records import COLUMNS
    from collector.storage import store as st

    path = str(tmp_path / "old.db")
    old = [c for c in COLUMNS if c.name != "peer_request_id"]
    old_cols = [c.name for c in old]
    db = sqlite3.connect(path)
    db.executescript(st.SCHEMA.format(cols=",\n  ".join(f'"{c.name}" {c.kind.sqlite}' for c in old)))
    given = {"trace_id": "00" * 16, "boundary": "client", "request_id": "old", "model": "m", "status": "ok"}
    given |= {"submit_ns": 0, "end_ns": 10, "input_tokens": 1, "output_tokens": 1, "estimated_tokens": 0}
    db.execute(
        f"INSERT INTO requests ({', '.join(old_cols)}, event_offsets_ns, event_tokens) VALUES "
        f"({', '.join('?' * len(old_cols))}, ?, ?)",
        [given.get(c) for c in old_cols] + [np.array([5], np.int64).tobytes(), np.array([1], np.int64).tobytes()],
    )
    db.commit()
    db.close()
    s = st.RequestStore(path)
    s.add(_batch(2, 9))
    recs = {r.request_id: r for r in s.records()}
    s.close()
    assert set(recs) == {"old", "q9-0", "q9-1"} and recs["old"].peer_request_id is None
    assert list(recs["old"].event_offsets_ns) == [5]


# -- wire-level: what protobuf accepts, the C walk reads the same -----------------------------------

REPRODUCER = (  # three spans; an unknown field (3, empty) inside the first one's token array
    "0ae20112df0112630a1011111111111111111111111111111111120801010101010101012a0b6c6c6d2e7265717565737439010000"
    "00000000004102000000000000004a260a1a6c6c6d2e746f6b656e5f6576656e742e6f6666736574735f6e7312082a060a02180"
    "11a00123b0a1011111111111111111111111111111111120802020202020202022a0b6c6c6d2e72657175657374390100000000"
    "000000410200000000000000123b0a1011111111111111111111111111111111120803030303030303032a0b6c6c6d2e726571"
    "75657374390100000000000000410200000000000000"
)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _ld(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _span(sid: int, array_payload: bytes) -> bytes:
    attr = _ld(1, sc.TOKEN_EVENT_OFFSETS.encode()) + _ld(2, _ld(5, array_payload))
    return (
        _ld(1, b"\x11" * 16)
        + _ld(2, bytes([sid]) * 8)
        + _ld(5, sc.SPAN_REQUEST.encode())
        + b"\x39"
        + (1).to_bytes(8, "little")
        + b"\x41"
        + (2).to_bytes(8, "little")
        + _ld(9, attr)
    )


UNKNOWN = [b"\x10\x01", b"\x1a\x00", b"\x25\x00\x00\x00\x00", b"\x19" + b"\x00" * 8]  # varint, bytes, fixed32/64


def test_the_reproducer_keeps_every_span():
    body = bytes.fromhex(REPRODUCER)
    fast, ref = decode.walk_bytes(body), walk_message(parse_request(body))
    assert ref.total == 3 and len(ref.spans) == 3
    assert fast is not None and (fast.total, fast.spans) == (ref.total, ref.spans)  # it returned 0 of 3


@pytest.mark.parametrize("unknown", UNKNOWN, ids=["varint", "bytes", "fixed32", "fixed64"])
@pytest.mark.parametrize("where", ["first", "between", "last", "only"])
def test_unknown_fields_inside_a_token_array(unknown, where):
    elems = [_ld(1, b"\x18" + _varint(v)) for v in (5, 9, 300)]
    parts = {"first": [unknown, *elems], "between": [elems[0], unknown, *elems[1:]], "last": [*elems, unknown]}
    parts["only"] = [unknown]
    array = b"".join(parts[where])
    spans = _ld(2, _span(1, array)) + _ld(2, _span(2, b"".join(elems)))  # ScopeSpans.spans
    body = _ld(1, _ld(2, spans))  # ExportTraceServiceRequest.resource_spans / ResourceSpans.scope_spans
    fast, ref = decode.walk_bytes(body), walk_message(parse_request(body))
    assert len(ref.spans) == 2
    assert fast is None or (fast.total, fast.spans) == (ref.total, ref.spans)  # protobuf's answer, or defer
    assert fast is not None  # these are plain valid payloads: no need to defer


@pytest.mark.parametrize(
    "offsets, tokens",
    [
        ([-(2**63)], [2**63 - 1]),  # the attacker's: a TTFT of -9.2e9 s and a negative token counter
        ([5 * 1_000_000, -1], [1, 1]),  # one event before the span starts
        ([5 * 1_000_000, 200 * 1_000_000], [1, 1]),  # one after it ends
        ([5 * 1_000_000], [-3]),  # a negative count
    ],
)
def test_token_events_outside_their_span_are_rejected_and_counted(offsets, tokens):
    ms = 1_000_000
    t = "77" * 16
    good = make_span(
        t,
        "b1" * 8,
        sc.SPAN_CLIENT_REQUEST,
        start=0,
        end=100 * ms,
        request_id="good",
        offsets=[10 * ms, 20 * ms],
        tokens=[1, 2],
    )
    bad = make_span(
        t, "b2" * 8, sc.SPAN_CLIENT_REQUEST, start=0, end=100 * ms, request_id="bad", offsets=offsets, tokens=tokens
    )
    batch, rm = derive([ReleasedTrace(bytes.fromhex(t), [good, bad], "grace")])
    recs = {r.request_id: r for r in batch.records()}
    assert recs["bad"].events_rejected == len(offsets) and recs["bad"].event_offsets_ns == []
    assert recs["bad"].ttft is None and recs["bad"].output_tokens == 0
    assert recs["good"].events_rejected == 0 and recs["good"].output_tokens == 3  # the rest of the batch as it was
    assert (rm.output_tokens >= 0).all() and (np.nan_to_num(rm.ttft) >= 0).all()


def test_model_labels_are_capped_and_cut(make_collector):
    """2,000 distinct 1 KB model names (the attack) make at most max_models series, each name cut."""
    from collector.exporters.prometheus import render
    from collector.pipeline.metrics_registry import MAX_LABEL_CHARS, OTHER_MODEL, MetricsRegistry

    ms = 1_000_000
    spans = [
        make_span(
            f"{i:032x}",
            f"{i + 1:016x}",
            sc.SPAN_CLIENT_REQUEST,
            start=0,
            end=50 * ms,
            request_id=f"r{i}",
            model=f"{i:04d}" + "m" * 1020,
            status="ok",
            offsets=[10 * ms],
            tokens=[1],
        )
        for i in range(2000)
    ]
    batch, rm = derive([ReleasedTrace(s[sp.TRACE_ID], [s], "grace") for s in spans])
    reg = MetricsRegistry(max_models=5)
    reg.record(batch, rm)
    models = {labels[1] for labels in reg.requests.series}
    assert len(models) == 6 and OTHER_MODEL in models  # 5 kept, the rest folded into one
    assert max(map(len, models)) == MAX_LABEL_CHARS
    assert reg.records_folded == 1995
    assert sum(reg.requests.series.values()) == 2000  # folded, not lost
    assert len(render(reg.snapshot())) < 200_000  # a scrape of a few series, not 487 MiB
    c = make_collector(max_models=2)
    assert c.registry.max_models == 2 and "metrics_records_folded" in c.self_counters()


# -- wire-level rewrites: the C walk gives protobuf's answer or defers ----------------------------


def _rewrite_corpus():
    """Valid payloads to rewrite: the sample request and a few generated ones with every attribute
    shape (strings, arrays, nested lists)."""
    import random

    rnd = random.Random(11)
    bodies = [_VALID]
    for i in range(6):
        req = ExportTraceServiceRequest()
        for r in range(1 + i % 3):
            rs = req.resource_spans.add()
            rs.resource.attributes.add(key="service.name").value.string_value = f"svc{r}"
            rs.schema_url = "https://opentelemetry.io/schemas/1.26.0"
            ss = rs.scope_spans.add()
            ss.scope.name, ss.scope.version = "otel-llm", "0.1"
            for k in range(3):
                s = ss.spans.add(
                    trace_id=rnd.randbytes(16),
                    span_id=rnd.randbytes(8),
                    parent_span_id=rnd.randbytes(8),
                    name=[sc.SPAN_REQUEST, sc.SPAN_CLIENT_REQUEST, sc.SPAN_QUEUE, "llm.engine.step"][k + i & 3],
                    kind=k,
                    start_time_unix_nano=10**9 + k,
                    end_time_unix_nano=2 * 10**9,
                    trace_state="a=b",
                )
                s.attributes.add(key=sc.REQUEST_ID).value.string_value = f"r{i}-{k}"
                s.attributes.add(key=sc.TOKEN_EVENT_OFFSETS).value.array_value.values.extend(
                    [AnyValue(int_value=x) for x in (5, 9, 2**40)]
                )
                s.attributes.add(key="other").value.kvlist_value.values.add(key="x").value.double_value = 1.5
                s.events.add(time_unix_nano=3, name="ev").attributes.add(key="e").value.bool_value = True
                s.links.add(trace_id=rnd.randbytes(16), span_id=rnd.randbytes(8))
                s.status.message, s.status.code = "fine", 1
        bodies.append(req.SerializeToString())
    return bodies


@needs_ext
def test_c_walk_on_wire_rewrites():
    """Every rewrite a sender may make at the wire level (tests/support/wire_mutator.py): 6,000 payloads,
    none where the C walk and protobuf disagree; the rewrites protobuf reads the same way as the
    original (unknown fields, padded varints, split containers) never make the C walk defer."""
    import random

    from support import wire_mutator as wm

    rnd = random.Random(5)
    corpus = _rewrite_corpus()
    accepted = rejected = 0
    for _ in range(5000):
        body = wm.mutate(rnd.choice(corpus), rnd)
        ok, _deferred = differential(body)
        accepted += ok
        rejected += not ok
    assert accepted > 2000 and rejected > 300  # both sides of the line were exercised
    for _ in range(1000):
        body = wm.mutate(rnd.choice(corpus), rnd, wm.BENIGN)
        ok, deferred_ = differential(body)
        assert ok and not deferred_, "a benign rewrite made the C walk defer"


@needs_ext
def test_c_walk_rejects_what_protobuf_rejects():
    """Invalid UTF-8 in a string the walk never returns (trace state, a skipped attribute's key or
    value, an event name, the scope's version), malformed bytes inside a skipped attribute, and
    key-value lists nested past protobuf's limit: all refused, as protobuf refuses them."""
    from support import wire_mutator as wm

    base = ExportTraceServiceRequest()
    rs = base.resource_spans.add()
    ss = rs.scope_spans.add()
    ss.scope.version = "SCOPEV"
    s = ss.spans.add(
        trace_id=b"\1" * 16,
        span_id=b"\2" * 8,
        name=sc.SPAN_REQUEST,
        start_time_unix_nano=1,
        end_time_unix_nano=2,
        trace_state="TSTATE",
    )
    s.attributes.add(key="SKIPKEY").value.string_value = "SKIPVAL"
    s.attributes.add(key="kv").value.kvlist_value.values.add(key="INNER").value.string_value = "x"
    s.events.add(name="EVNAME")
    good = base.SerializeToString()
    assert differential(good) == (True, False)
    for marker in (b"TSTATE", b"SKIPKEY", b"SKIPVAL", b"INNER", b"EVNAME", b"SCOPEV"):
        for bad in wm.BAD_UTF8:
            body = good.replace(marker, bad + marker[len(bad) :] if len(bad) <= len(marker) else marker)
            assert body != good
            assert differential(body) == (False, True), (marker, bad)
    # a truncated varint inside the skipped kvlist attribute: same length, bytes broken
    i = good.index(b"INNER")
    broken = good[: i - 2] + b"\xff" + good[i - 1 :]
    assert differential(broken)[0] is False
    # nesting: protobuf takes 31 levels of key-value lists under a span attribute and refuses 32
    for depth, ok in ((20, True), (31, True), (32, False), (60, False)):
        tree = wm.parse(good)
        kv = next(f for f, _ in wm._all(tree) if f.msg == wm.KEYVALUE)
        kv.value = [kv.value[0], wm._nested_kvlist(depth)]
        assert differential(wm.serialize(tree))[0] is ok, depth


@needs_ext
def test_c_walk_reads_string_value_strindex():
    """AnyValue field 8 (string_value_strindex) is a member of the value oneof: after it, the
    attribute is not a string (protobuf's answer), in the walk of a value and of an array."""
    from opentelemetry.proto.common.v1 import common_pb2

    base = ExportTraceServiceRequest()
    s = (
        base.resource_spans.add()
        .scope_spans.add()
        .spans.add(
            trace_id=b"\1" * 16, span_id=b"\2" * 8, name=sc.SPAN_REQUEST, start_time_unix_nano=1, end_time_unix_nano=2
        )
    )
    assert "string_value_strindex" in common_pb2.AnyValue.DESCRIPTOR.fields_by_name
    s.attributes.add(key=sc.REQUEST_ID).value.string_value = "abc"
    s.attributes.add(key=sc.TOKEN_EVENT_OFFSETS).value.array_value.values.add(int_value=5)
    from support import wire_mutator as wm

    tree = wm.parse(base.SerializeToString())
    anys = [f for f, _ in wm._all(tree) if f.msg == wm.ANYVALUE]
    for a in anys:
        a.value.append(wm.Field(8, 0, 2))
    body2 = wm.serialize(tree)
    assert differential(body2) == (True, False)
    w = decode.walk_bytes(body2)
    rid_slot, off_slot = sp.ATTRIBUTE_SLOTS[sc.REQUEST_ID], sp.ATTRIBUTE_SLOTS[sc.TOKEN_EVENT_OFFSETS]
    assert w.spans[0][9 + rid_slot] is sp.INVALID and w.spans[0][9 + off_slot] is sp.INVALID


def test_the_http_server_span_gives_the_seven_parts():
    """client -> HTTP server span -> engine span: paired on the fast path through the server span,
    and the client TTFT splits into network_in + api_in + front_end + queue + prefill + api_out +
    network_out, exactly, in integer ns; api_out ends at the first chunk written once the engine
    had a token out (an earlier chunk, e.g. response headers flushed, does not count)."""
    t = "ab" * 16
    ms = 1_000_000
    spans = [
        make_span(
            t,
            "c1" * 8,
            sc.SPAN_CLIENT_REQUEST,
            start=0,
            end=200 * ms,
            request_id="r",
            offsets=[70 * ms, 90 * ms],
            tokens=[1, 1],
        ),
        make_span(
            t,
            "5e" * 8,
            "POST /v1/completions",
            parent="c1" * 8,
            start=3 * ms,
            end=195 * ms,
            chunk_offsets=[1 * ms, 61 * ms, 81 * ms],
        ),
        make_span(
            t,
            "e1" * 8,
            sc.SPAN_REQUEST,
            parent="5e" * 8,
            start=5 * ms,
            end=190 * ms,
            request_id="r",
            offsets=[57 * ms, 77 * ms],
            tokens=[1, 1],
        ),
        make_span(t, "0f" * 8, sc.SPAN_FRONTEND, parent="e1" * 8, start=5 * ms, end=9 * ms),
        make_span(t, "01" * 8, sc.SPAN_QUEUE, parent="e1" * 8, start=9 * ms, end=20 * ms),
        make_span(t, "02" * 8, sc.SPAN_PREFILL, parent="e1" * 8, start=20 * ms, end=60 * ms),
    ]
    batch, _ = derive([ReleasedTrace(bytes.fromhex(t), spans, "grace")])
    recs = {r.boundary: r for r in batch.records()}
    assert set(recs) == {"client", "server", "engine"} and recs["client"].paired
    # the server boundary: the engine's token events at the chunks that carried them (64 and 84 ms)
    srv = recs["server"]
    assert (srv.submit_ns, srv.end_ns, list(srv.event_offsets_ns)) == (3 * ms, 195 * ms, [61 * ms, 81 * ms])
    assert srv.ttft == pytest.approx(0.061) and srv.itl_max == pytest.approx(0.020) and srv.output_tokens == 2
    assert srv.request_id == "r" and not srv.paired
    c = recs["client"]
    assert c.network_in == pytest.approx(0.003) and c.api_in == pytest.approx(0.002)
    assert (c.front_end, c.queue, c.prefill) == pytest.approx((0.004, 0.011, 0.040))
    # engine first output at 5 + 57 = 62 ms; the server's chunks at 4, 64, 84 ms: the first after it is 64
    assert c.api_out == pytest.approx(0.004) and c.network_out == pytest.approx(0.006)
    assert c.to_engine == pytest.approx(0.005) and c.delivery == pytest.approx(0.010)
    parts = [c.network_in, c.api_in, c.front_end, c.queue, c.prefill, c.api_out, c.network_out]
    assert sum(parts) == pytest.approx(c.ttft, abs=1e-12) and c.ttft == pytest.approx(0.070)
    assert c.server_received_ns == 3 * ms and c.server_first_chunk_ns == 64 * ms
    from collector.analysis.compare import compare

    (row,) = compare(batch.records()).rows
    assert set(row.parts) == {"network_in", "api_in", "front_end", "queue", "prefill", "api_out", "network_out"}
    assert row.parts_sum_minus_ttft == pytest.approx(0, abs=1e-9)
    # a client that says when it began writing the request (otel-llm's: httpcore's trace events):
    # its own part, and network_in from there; an offset past the span's end is not taken
    for offset, send in ((1 * ms, 0.001), (None, None), (-5, None), (201 * ms, None), ("1", None)):
        k = sp.SEND_OFFSET
        sent = [spans[0][:k] + (offset,) + spans[0][k + 1 :], *spans[1:]]
        c = {r.boundary: r for r in derive([ReleasedTrace(bytes.fromhex(t), sent, "grace")])[0].records()}["client"]
        assert c.client_send == (None if send is None else pytest.approx(send))
        assert c.network_in == pytest.approx(0.003 - (send or 0)) and c.to_engine == pytest.approx(0.005)
        (row,) = compare([c, *(r for r in batch.records() if r.boundary != "client")]).rows
        assert ("client_send" in row.parts) == (send is not None)
        assert row.parts_sum_minus_ttft == pytest.approx(0, abs=1e-9)
