"""engine_hooks.asgi.TracingMiddleware without a server: what the app sees and sends is unchanged
but for the traceparent it hands on; every body chunk is timed; probes are skipped; a failing app
still gets its span and its exception."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from array import array

import pytest
from conftest import c_or_python

from engine_hooks import asgi
from engine_hooks.asgi import TracingMiddleware, parse_traceparent
from engine_hooks.hot_path.hook_events import RAW
from engine_hooks.hot_path.recorder import Recorder
from engine_hooks.spans.tracker import RequestTracker


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
    c_or_python(monkeypatch, pure_python, asgi._hotpath)
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
        # flags are exactly two lowercase hex digits (each answered 400 or 500 before: #47)
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-100",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1ff",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0x1ff",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1_00",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-" + b"f" * 40,
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0",
        # each id exactly its width, lowercase; version 00 ends at its flags
        b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
        b"00-4bf92f3577b34da6a3ce929d0e0e47360-0f067aa0ba902b7-01",
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        b"0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        b"\xff\xfe-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        b"",
    ],
)
@pytest.mark.parametrize("pure_python", [False, True], ids=["C", "Python"])
def test_a_bad_traceparent_starts_a_new_trace(monkeypatch, bad, pure_python):
    c_or_python(monkeypatch, pure_python, asgi._hotpath)
    rec = Recorder()
    headers = [(b"traceparent", bad), (b"tracestate", b"vendor=abc"), (b"x-other", b"1")]
    _, sent, seen = run(streaming_app, headers=headers, recorder=rec)
    assert sent[0]["status"] == 200 and len(sent) == 7  # served as if the header were absent
    (h,) = records(rec)
    assert h.parent_span_id is None and any(h.trace_id) and h.status == 200
    handed = seen["headers"]
    assert parse_traceparent(dict(handed)[b"traceparent"])[0] == h.trace_id
    # a new trace: the state that came with the ignored parent is not handed on with ours
    assert [k for k, _ in handed] == [b"x-other", b"traceparent"]


FIRST = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
SECOND = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    "headers, parent",
    [
        ([(b"traceparent", FIRST), (b"traceparent", SECOND)], FIRST),
        ([(b"TraceParent", FIRST), (b"x", b"1"), (b"TRACEPARENT", SECOND), (b"traceparent", SECOND)], FIRST),
        ([(b"traceparent", b"00-bad"), (b"traceparent", SECOND)], None),  # the first decides, as the SDK reads it
        ([(b"tracestate", b"a=1"), (b"traceparent", FIRST), (b"traceparent", SECOND), (b"tracestate", b"b=2")], FIRST),
        ([["TraceParent", FIRST.decode()], [b"traceparent", SECOND]], FIRST),  # not ASGI's shape: in Python
    ],
    ids=["two", "three, any spelling", "an invalid first", "with tracestate", "list pairs"],
)
@pytest.mark.parametrize("pure_python", [False, True], ids=["C", "Python"])
def test_every_caller_traceparent_is_replaced_by_the_server_spans(monkeypatch, headers, parent, pure_python):
    """A second (or third) traceparent header must not reach the app, or the engine's spans follow
    it into another trace than the server span's (#47): the first one in any spelling is the
    parent where valid, every one is removed, and exactly one, the server span's, is handed on;
    the caller's tracestate goes on with its own parent only."""
    c_or_python(monkeypatch, pure_python, asgi._hotpath)
    rec = Recorder()
    _, sent, seen = run(streaming_app, headers=headers, recorder=rec)
    assert sent[0]["status"] == 200
    (h,) = records(rec)
    names = [(k.encode() if isinstance(k, str) else k).lower() for k, _ in seen["headers"]]
    assert names.count(b"traceparent") == 1
    handed = parse_traceparent(next(v for k, v in seen["headers"] if k == b"traceparent"))
    assert handed[:2] == (h.trace_id, h.span_id)  # the engine's spans join the server span's trace
    if parent is None:
        assert h.parent_span_id is None and b"tracestate" not in names
    else:
        want = parse_traceparent(parent)
        assert (h.trace_id, h.parent_span_id) == want[:2]
        states = [v for k, v in seen["headers"] if k == b"tracestate"]
        assert states == [v for k, v in headers if k == b"tracestate"]


def test_a_failure_before_the_app_serves_the_request_untraced():
    """Nothing the middleware does before the app runs may raise into the server: a sampler
    that raises leaves the request served, untraced."""
    rec = Recorder()

    async def inner(scope, receive, send):
        await streaming_app(scope, receive, send)

    mw = TracingMiddleware(inner, recorder=rec)

    def broken(*a, **k):
        raise RuntimeError("sampler failed")

    mw._decide = broken
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"traceparent", FIRST)]}
    asyncio.run(mw(scope, receive, send))
    assert sent[0]["status"] == 200 and len(sent) == 7 and records(rec) == []


@pytest.mark.parametrize(
    "headers",
    [
        [(b"host", b"x"), (b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")],
        [(b"Traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), (b"host", b"x")],
        [(b"traceparent", b"cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-a-later-version")],
        [["x-a", "1"], [b"TRACEPARENT", b" 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 "]],
    ],
    ids=["lowercase", "any case", "list pairs, a str name, spaces", "a later version"],
)
@pytest.mark.parametrize("pure_python", [False, True], ids=["C", "Python"])
def test_the_caller_traceparent_is_found_however_the_server_spells_it(monkeypatch, headers, pure_python):
    """Header names are looked up in any case (in C where ASGI's shape: a list of tuples with
    bytes names; in Python otherwise); a later version's value may go on after its flags."""
    c_or_python(monkeypatch, pure_python, asgi._hotpath)
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

    from engine_hooks.spans.span_factory import SpanFactory
    from otel_llm import semconv as sc

    rec = Recorder()
    run(streaming_app, recorder=rec)
    (h,) = records(rec)
    s = SpanFactory(Resource.create({})).http_span(h, lambda m: m)
    assert s.name == "POST /v1/completions" and s.kind.name == "SERVER"
    a = s.attributes
    assert a[sc.HTTP_METHOD] == "POST" and a[sc.URL_PATH] == "/v1/completions" and a[sc.HTTP_STATUS] == 200
    assert a[sc.BOUNDARY] == "server" and list(a[sc.HTTP_CHUNK_OFFSETS]) == [m - h.start_mono for m in h.chunk_mono]


@contextlib.contextmanager
def uvicorn_server(app, http: str):
    """A real uvicorn server (``http``: httptools or h11) in a thread; yields its port."""
    import threading
    import time

    import uvicorn

    from engine_hooks.tiny_model import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def read_responses(sock, n: int) -> bytes:
    """``n`` whole chunked responses, or content-length ones, off one connection."""
    answer = b""
    while answer.count(b"HTTP/1.1 2") < n or not _whole(answer):
        more = sock.recv(65536)
        assert more, answer
        answer += more
    return answer


def _whole(answer: bytes) -> bool:
    last = answer[answer.rindex(b"HTTP/1.1 2") :]
    if b"content-length: " in last.lower():
        head, _, body = last.partition(b"\r\n\r\n")
        size = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        return len(body) >= size
    return last.endswith(b"0\r\n\r\n")


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_the_span_starts_at_the_request_first_byte_under_uvicorn(http):
    """A real uvicorn server: the request's first half, 80 ms, then the rest. The server span
    starts when uvicorn began reading it, and says when the app was called (80 ms later here:
    what network_in held before, named for what it is)."""
    import socket
    import time

    rec = Recorder()
    app = TracingMiddleware(streaming_app, recorder=rec)  # installs the first-byte stamp
    with uvicorn_server(app, http) as port:
        request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(request[:20])
            time.sleep(0.08)
            s.sendall(request[20:])
            answer = read_responses(s, 1)
        assert answer.startswith(b"HTTP/1.1 200")
    (h,) = records(rec)
    assert 0.07e9 <= h.app_start_mono - h.start_mono <= 1e9
    assert h.start_mono <= h.app_start_mono <= h.response_start_mono <= h.chunk_mono[0]


async def sized_app(scope, receive, send):
    """A content-length response in three writes; the middle one is what a chunked response's end
    looks like, and is a chunk here."""
    await send({"type": "http.response.start", "status": 203, "headers": [(b"content-length", b"11")]})
    for part in (b"abc", b"0\r\n\r\n", b"xyz"):
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.mark.parametrize("pure_python", [False, True], ids=["C", "Python"])
@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_under_uvicorn_the_writes_are_timed_and_the_app_gets_the_servers_send(monkeypatch, http, pure_python):
    """Under uvicorn with the C accelerator each connection's transport is timed: the app is
    handed uvicorn's own ``send``, and every response still gets its status, its start and one
    time per body chunk written, whatever the framing: chunked (its empty last chunk is no
    chunk), content-length, an interim ``100 Continue`` first (not the response's start), and
    several requests pipelined on one kept-alive connection, each its own. In Python, the app's
    send is wrapped, and the records are the same."""
    import socket

    c_or_python(monkeypatch, pure_python, asgi._hotpath)
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.h11_impl import RequestResponseCycle as H11Cycle
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as ToolsCycle

    sends = []

    async def app(scope, receive, send):
        if scope["type"] != "http":  # uvicorn's lifespan: nothing to do
            return
        sends.append(send)
        await receive()
        if scope["path"] == "/sized":
            await sized_app(scope, receive, send)
        else:
            await streaming_app(scope, receive, send)

    rec = Recorder()
    traced = TracingMiddleware(app, recorder=rec)
    for protocol in (HttpToolsProtocol, H11Protocol):  # each protocol's connections made as its own
        assert protocol.connection_made.__wrapped__.__qualname__ == f"{protocol.__name__}.connection_made"
    with uvicorn_server(traced, http) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        post = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
        s.sendall(post % b"/a" + post % b"/sized" + post % b"/b")  # pipelined
        answer = read_responses(s, 3)
        s.sendall(b"POST /c HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
        interim = s.recv(65536)
        if interim.startswith(b"HTTP/1.1 100"):
            s.sendall(b"{}")
            answer += read_responses(s, 1)
        else:  # the interim answer comes with the body read: not before it
            s.sendall(b"{}")
            answer += interim + read_responses(s, 1)
    assert answer.count(b"data: 4") == 3 and b"abc0\r\n\r\nxyz" in answer
    cycles = (ToolsCycle, H11Cycle)
    assert len(sends) == 4 and all(isinstance(getattr(f, "__self__", None), cycles) != pure_python for f in sends)
    hs = sorted(records(rec), key=lambda h: h.start_mono)
    assert [h.path for h in hs] == ["/a", "/sized", "/b", "/c"]
    assert [h.status for h in hs] == [200, 203, 200, 200]
    assert [len(h.chunk_mono) for h in hs] == [5, 3, 5, 5]
    for h in hs:
        assert h.app_start_mono <= h.response_start_mono <= h.chunk_mono[0] <= h.chunk_mono[-1] <= h.end_mono
    for a, b in itertools.pairwise(hs):  # one after another, each its own writes
        assert a.chunk_mono[-1] <= b.response_start_mono


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

    ts = asgi._hotpath.TimedSend(lambda m: ("sent", m))
    assert ts.take() == (None, None, b"")  # nothing yet
    start = {"type": "http.response.start", "status": 201}
    body = {"type": "http.response.body", "body": b"data: x\n\n", "more_body": True}
    assert ts(start) == ("sent", start)
    status, started, _ = ts.take()
    assert status == 201 and type(started) is int
    before = sys.getrefcount(body)
    for i in range(100):  # past the first 64 the C array grows
        message = body if i % 2 else {**body, "body": bytearray(b"x")}  # any body that is not empty
        assert ts(message)[1] is message
    del message
    assert sys.getrefcount(body) == before
    chunks = array("q", ts.take()[2])
    assert len(chunks) == 100 and list(chunks) == sorted(chunks) and started <= chunks[0]
    ts({"type": "http.response.body", "body": b""})  # the empty closing body is no chunk
    ts({"type": "http.response.body"})  # nor one without a body
    ts({"type": "http." + "response.body", "body": b"x"})  # the type compared by its text
    ts(["not", "a", "dict"])  # not ASGI's: handed on untouched
    assert len(ts.take()[2]) == 101 * 8
    for call in (lambda: ts(), lambda: ts(body, body), lambda: ts(message=body)):
        with pytest.raises(TypeError):
            call()
    with pytest.raises(TypeError):
        asgi._hotpath.TimedSend(print, None)  # send alone


@pytest.mark.skipif(asgi._hotpath is None, reason="the C accelerator is not built here")
def test_the_timed_transport_notes_the_writes_and_is_the_transport_otherwise():
    """``_hotpath.TimedTransport`` is what uvicorn's protocol writes through: every write goes to
    the transport as it is; with a timer set, the response's head (not an interim 1xx) gives its
    start and status, and each write with a body after it is a chunk, but for the chunked coding's
    empty last chunk; junk is written and never noted, nothing raises but the transport's own
    errors, and no reference is kept but the transport's."""
    import gc
    import sys

    class Raw:
        def __init__(self):
            self.out = []
            self.closing = False

        def write(self, data):
            if data == b"boom":
                raise ConnectionResetError("gone")
            self.out.append(data)

        def is_closing(self):
            return self.closing

    raw = Raw()
    before = sys.getrefcount(raw)
    tt = asgi._hotpath.TimedTransport(raw)
    assert tt.timer is None and tt.transport is raw
    tt.write(b"HTTP/1.1 200 OK\r\n\r\n")  # no timer: written only
    tt.closing = True  # anything but its own attributes is the transport's
    assert tt.is_closing() is True and raw.closing is True
    with pytest.raises(AttributeError):
        tt.no_such_thing  # noqa: B018
    with pytest.raises(TypeError):
        tt.timer = object()
    chunked = asgi._hotpath.TimedSend(print)
    tt.timer = chunked
    head = b"HTTP/1.1 404 Not Found\r\ncontent-type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
    for data in (b"HTTP/1.1 100 Continue\r\n\r\n", head, b"", b"5\r\nhello\r\n", bytearray(b"x"), b"0\r\n\r\n"):
        tt.write(data)
    status, started, chunks = chunked.take()
    assert status == 404 and type(started) is int and len(chunks) == 8  # one chunk: hello
    assert raw.out[-5:] == [head, b"", b"5\r\nhello\r\n", bytearray(b"x"), b"0\r\n\r\n"]
    sized = asgi._hotpath.TimedSend(print)
    tt.timer = sized
    for junk in (b"HTTP/1.1 2x0 OK\r\n\r\n", b"HTTP/1.", b"GARBAGE 200 OK\r\n\r\n", "HTTP/1.1 200 OK\r\n\r\n", None):
        tt.write(junk)
    assert sized.take() == (None, None, b"")  # no head seen: nothing noted
    tt.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n")
    tt.write(b"0\r\n\r\n")  # a body that looks like the chunked end: a chunk here
    assert sized.take()[0] == 200 and len(sized.take()[2]) == 8
    with pytest.raises(ConnectionResetError):
        tt.write(b"boom")  # the transport's own error, as it raised it
    assert len(sized.take()[2]) == 16  # noted before it was handed on
    tt.timer = None
    assert tt.timer is None
    del tt
    gc.collect()
    assert sys.getrefcount(raw) == before


@pytest.mark.skipif(asgi._hotpath is None, reason="the C accelerator is not built here")
def test_the_c_traceparent_reader_and_writer_agree_with_the_python_ones():
    """Header lists and traceparent values shaped by hand and mutated at random, byte by byte:
    ``_hotpath.take_traceparent`` reads the parent the Python reader reads and leaves the same
    headers, and refuses what is not ASGI's shape without touching it; ``_hotpath.traceparent``
    writes what the Python writer writes."""
    import random

    c = asgi._hotpath
    rng = random.Random(7)
    good = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    alphabet = b"0123456789abcdefABCDEFgG-_ \t\x00\xff"

    def mutated() -> bytes:
        v = bytearray(good)
        if rng.random() < 0.1:
            v[:2] = rng.choice([b"01", b"ff", b"cc"])
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            roll = rng.random()
            if roll < 0.6:
                v[rng.randrange(len(v))] = rng.choice(alphabet)
            elif roll < 0.8:
                del v[rng.randrange(len(v))]
            else:
                v.insert(rng.randrange(len(v) + 1), rng.choice(alphabet))
        if rng.random() < 0.1:
            v[3:35] = b"0" * 32  # an all-zero trace id
        return bytes(v)

    names = [b"traceparent", b"TraceParent", b"TRACEPARENT", b"traceparenT", b"traceparent2", b"trace-parent", b"x"]
    names += [b"tracestate", b"TraceState"]
    kinds = collections.Counter()
    for _ in range(3000):
        headers = [(rng.choice(names), mutated()) for _ in range(rng.randrange(5))]
        headers.insert(rng.randrange(len(headers) + 1), (b"host", b"x"))
        in_c, in_python = list(headers), list(headers)
        got = c.take_traceparent(in_c)
        assert got == asgi.take_traceparent(in_python), headers
        assert in_c == in_python, headers
        assert not any(k.lower() == b"traceparent" for k, _ in in_c)
        kinds[
            "none" if not any(k.lower() == b"traceparent" for k, _ in headers) else "parent" if got else "invalid"
        ] += 1
    assert min(kinds[k] for k in ("none", "invalid", "parent")) >= 100, kinds  # each way, often
    for not_asgi in ([["traceparent", good]], [(b"traceparent",)], [(b"a", b"b", b"c")], ((b"traceparent", good),)):
        before = list(not_asgi)
        with pytest.raises(TypeError):
            c.take_traceparent(not_asgi)
        assert list(not_asgi) == before
    for _ in range(200):
        t, s, f = rng.randbytes(16), rng.randbytes(8), rng.randrange(256)
        assert c.traceparent(t, s, f) == asgi.make_traceparent(t, s, f)
        assert asgi.parse_traceparent(c.traceparent(t, s, f)) == ((t, s, f) if any(t) and any(s) else None)
    for bad in ((b"x" * 15, b"s" * 8, 1), (b"t" * 16, b"s" * 8, 256), (b"t" * 16, "s" * 8, 1)):
        with pytest.raises((TypeError, ValueError)):
            c.traceparent(*bad)


@pytest.mark.skipif(asgi._hotpath is None, reason="the C accelerator is not built here")
def test_a_probe_on_the_same_connection_is_not_counted_in_the_traced_response_before_it():
    """A traced response whose app is still running after its last body write (a background
    task, here 0.3 s), and a health probe pipelined behind it on the same connection: uvicorn
    answers the probe meanwhile, and its writes are not the traced response's chunks."""
    import socket

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        await streaming_app(scope, receive, send)
        await asyncio.sleep(0.3)  # still running: the probe is answered before this returns

    rec = Recorder()
    with (
        uvicorn_server(TracingMiddleware(app, recorder=rec), "httptools") as port,
        socket.create_connection(("127.0.0.1", port), timeout=10) as s,
    ):
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        answer = b""
        while not answer.endswith(b"ok"):
            more = s.recv(65536)
            assert more, answer
            answer += more
        time.sleep(0.5)  # the traced app returns and records
    (h,) = records(rec)  # the probe: no span
    assert h.path == "/v1/completions" and h.status == 200 and len(h.chunk_mono) == 5


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_two_copies_of_the_middleware_under_uvicorn_record_one_span_with_every_chunk(http):
    """The plugin's middleware and a ``--middleware`` copy both in the app: the outer one traces
    the request, the inner one passes it through and leaves the outer one's timing alone."""
    import socket

    rec = Recorder()
    app = TracingMiddleware(TracingMiddleware(streaming_app, recorder=rec), recorder=rec)
    with uvicorn_server(app, http) as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        assert read_responses(s, 1).startswith(b"HTTP/1.1 200")
        time.sleep(0.2)  # the app returns and records
    (h,) = records(rec)
    assert h.status == 200 and len(h.chunk_mono) == 5
