"""engine_hooks.asgi.TracingMiddleware without a server: what the app sees and sends is unchanged
but for the traceparent it hands on; every body chunk is timed; probes are skipped; a failing app
still gets its span and its exception."""

from __future__ import annotations

import asyncio
import pickle
from array import array

import pytest

from engine_hooks import asgi
from engine_hooks.asgi import TracingMiddleware, parse_traceparent
from engine_hooks.recorder import RAW, Recorder
from engine_hooks.tracker import RequestTracker


def run(app, path="/v1/completions", headers=(), recorder=None):
    sent, seen = [], {}

    async def inner(scope, receive, send):
        seen.update(scope)
        await app(scope, receive, send)

    mw = TracingMiddleware(inner, recorder=recorder if recorder is not None else Recorder())

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": path, "headers": list(headers)}
    asyncio.run(mw(scope, receive, send))
    return mw, sent, seen


async def streaming_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(5):
        await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
        await asyncio.sleep(0.002)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def records(rec: Recorder):
    t = RequestTracker()
    events = rec.drain()
    assert all(e[0] == RAW for e in events)
    t.feed(events)
    return t.take_http()


@pytest.mark.parametrize("pure_python", [False, True])
def test_chunks_timed_and_traceparent_handed_on(monkeypatch, pure_python):
    """The same with each chunk timed in C (the accelerator) and in Python."""
    if pure_python:
        monkeypatch.setenv("OTEL_LLM_PURE_PYTHON", "1")
    elif asgi._hotpath is None:
        pytest.skip("the C accelerator is not built here")
    rec = Recorder()
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    mw, sent, seen = run(streaming_app, headers=[(b"traceparent", tp.encode()), (b"x-other", b"1")], recorder=rec)
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 6  # unchanged
    assert sent[1]["body"] == b"data: 0\n\n"
    handed = dict(seen["headers"])
    assert handed[b"x-other"] == b"1"
    new = parse_traceparent(handed[b"traceparent"])
    assert new[0].hex() == "4bf92f3577b34da6a3ce929d0e0e4736" and new[1].hex() != "00f067aa0ba902b7"
    assert (mw._timed_send is None) == pure_python
    (h,) = records(rec)
    assert h.status == 200 and len(h.chunk_mono) == 5  # the empty closing body is not a chunk
    assert all(type(t) is int for t in h.chunk_mono) and type(h.response_start_mono) is int
    assert h.start_mono <= h.response_start_mono <= h.chunk_mono[0] and list(h.chunk_mono) == sorted(h.chunk_mono)
    assert type(h.chunk_mono) is array  # to the span process as one bytes object, not an int object each
    assert h.chunk_mono[-1] - h.chunk_mono[0] >= 4 * 2_000_000 * 0.9
    assert h.parent_span_id.hex() == "00f067aa0ba902b7" and h.span_id == new[1]


@pytest.mark.parametrize(
    "bad",
    [
        b"garbage",
        b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01",
        b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7--1",  # flags are two hex digits
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-+1",
        b"00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-" + b"0" * 16 + b"-01",
        b"00-4bf92f3577b34da6a3ce929d0e0e47 6-00f067aa0ba902b7-01",
        b"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ],
)
def test_a_bad_traceparent_starts_a_new_trace(bad):
    rec = Recorder()
    _, _, seen = run(streaming_app, headers=[(b"traceparent", bad)], recorder=rec)
    (h,) = records(rec)
    assert h.parent_span_id is None and any(h.trace_id)
    assert parse_traceparent(dict(seen["headers"])[b"traceparent"])[0] == h.trace_id


@pytest.mark.parametrize(
    "headers",
    [
        [(b"host", b"x"), (b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")],
        [(b"Traceparent", b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01"), (b"host", b"x")],
        [["x-a", "1"], [b"TRACEPARENT", b" 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 "]],
    ],
    ids=["lowercase", "any case", "list pairs, a str name, spaces"],
)
def test_the_caller_traceparent_is_found_however_the_server_spells_it(headers):
    """Header names are looked up in C among lowercase names (what ASGI servers hand over), and
    in any case otherwise; the value is read at its fixed places, or parsed in full when it is not
    the usual 55 bytes."""
    rec = Recorder()
    _, _, seen = run(streaming_app, headers=headers, recorder=rec)
    (h,) = records(rec)
    assert h.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736" and h.parent_span_id.hex() == "00f067aa0ba902b7"
    handed = [k for k, _ in seen["headers"] if isinstance(k, bytes) and k.lower() == b"traceparent"]
    assert handed == [b"traceparent"]  # the caller's replaced by the server span's


def test_probes_get_no_span():
    rec = Recorder()
    run(streaming_app, path="/health", recorder=rec)
    run(streaming_app, path="/metrics", recorder=rec)
    assert records(rec) == []


def test_a_failing_app_keeps_its_exception_and_its_span():
    async def boom(scope, receive, send):
        await send({"type": "http.response.start", "status": 500, "headers": []})
        raise RuntimeError("engine died")

    rec = Recorder()
    with pytest.raises(RuntimeError, match="engine died"):
        run(boom, recorder=rec)
    (h,) = records(rec)
    assert h.status == 500 and list(h.chunk_mono) == []


def test_the_span_follows_the_http_conventions():
    from opentelemetry.sdk.resources import Resource

    from engine_hooks.span_factory import SpanFactory
    from otel_llm import semconv as sc

    rec = Recorder()
    run(streaming_app, recorder=rec)
    (h,) = records(rec)
    s = SpanFactory(Resource.create({})).http_span(h, lambda m: m)
    assert s.name == "POST /v1/completions" and s.kind.name == "SERVER"
    a = s.attributes
    assert a[sc.HTTP_METHOD] == "POST" and a[sc.URL_PATH] == "/v1/completions" and a[sc.HTTP_STATUS] == 200
    assert a[sc.BOUNDARY] == "server" and list(a[sc.HTTP_CHUNK_OFFSETS]) == [m - h.start_mono for m in h.chunk_mono]


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_the_span_starts_at_the_request_first_byte_under_uvicorn(http):
    """A real uvicorn server: the request's first half, 80 ms, then the rest. The server span
    starts when uvicorn began reading it, and says when the app was called (80 ms later here:
    what network_in held before, named for what it is)."""
    import socket
    import threading
    import time

    import uvicorn

    from engine_hooks.tiny_model import free_port

    rec = Recorder()
    app = TracingMiddleware(streaming_app, recorder=rec)  # installs the first-byte stamp
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(request[:20])
            time.sleep(0.08)
            s.sendall(request[20:])
            answer = b""
            while not answer.endswith(b"0\r\n\r\n"):
                answer += s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200")
    finally:
        server.should_exit = True
        thread.join(10)
    (h,) = records(rec)
    assert 0.07e9 <= h.app_start_mono - h.start_mono <= 1e9
    assert h.start_mono <= h.app_start_mono <= h.response_start_mono <= h.chunk_mono[0]


@pytest.mark.parametrize(
    "sampler",
    ["parentbased_always_on", "always_on", "parentbased_traceidratio", "always_off", "parentbased_always_off"],
)
def test_the_usual_samplers_are_decided_as_the_sdk_decides(monkeypatch, sampler):
    """The middleware decides the SDK's default sampler (and always_on) without building a context
    for it: the same decision and probability as asking the sampler, with and without a caller's
    traceparent, sampled or not; any other sampler is asked."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    mw = TracingMiddleware(lambda *a: None, recorder=Recorder())
    assert mw._shortcut == {"parentbased_always_on": "parent", "always_on": "always"}.get(sampler)
    asked = TracingMiddleware(lambda *a: None, recorder=Recorder())
    asked._shortcut = None  # the general path: the SDK's sampler, asked
    scope = {"method": "POST", "path": "/v1/completions"}
    for trace_id in (b"\x01" * 16, b"\xff" * 16, bytes(range(16))):
        for parent in (None, (trace_id, b"\x02" * 8, 1), (trace_id, b"\x02" * 8, 0)):
            assert mw._decide(parent, trace_id, scope) == asked._decide(parent, trace_id, scope), (parent, trace_id)


@pytest.mark.skipif(asgi._hotpath is None, reason="the C accelerator is not built here")
def test_the_c_send_hands_back_what_send_gives_and_keeps_no_reference():
    """``_hotpath.TimedSend`` is the app's ``send`` under the accelerator: called by vectorcall
    with exactly one message, it times body chunks with a body, takes the response's start and
    status, hands back whatever ``send`` returns, and holds nothing it was given."""
    import sys

    from engine_hooks.asgi import HttpRecord

    h = HttpRecord(0, 0, "POST", "/", None, None, None)
    ts = asgi._hotpath.TimedSend(lambda m: ("sent", m), h)
    assert ts.chunks() == array("q")  # none yet
    start = {"type": "http.response.start", "status": 201}
    body = {"type": "http.response.body", "body": b"data: x\n\n", "more_body": True}
    assert ts(start) == ("sent", start) and h.status == 201 and type(h.response_start_mono) is int
    before = sys.getrefcount(body)
    for i in range(100):  # past the first 64 the C array grows
        message = body if i % 2 else {**body, "body": bytearray(b"x")}  # any body that is not empty
        assert ts(message)[1] is message
    del message
    assert sys.getrefcount(body) == before
    chunks = ts.chunks()
    assert type(chunks) is array and chunks.typecode == "q" and len(chunks) == 100 and list(chunks) == sorted(chunks)
    assert h.response_start_mono <= chunks[0] and pickle.loads(pickle.dumps(chunks, 5)) == chunks
    ts({"type": "http.response.body", "body": b""})  # the empty closing body is no chunk
    ts({"type": "http.response.body"})  # nor one without a body
    ts({"type": "http." + "response.body", "body": b"x"})  # the type compared by its text
    ts(["not", "a", "dict"])  # not ASGI's: handed on untouched
    assert len(ts.chunks()) == 101
    for call in (lambda: ts(), lambda: ts(body, body), lambda: ts(message=body)):
        with pytest.raises(TypeError):
            call()
    with pytest.raises(TypeError):
        asgi._hotpath.TimedSend(print)  # send and the record
