"""engine_hooks.trace_proxy (#43): a Python ASGI proxy traced with one call. The calls it makes to
its backends while serving a request carry that request's server span as their parent (httpx, sync
and async, and aiohttp, as a real backend reads the header off the wire); a call that sets its own
traceparent keeps it; a call made outside a served request gets none. And the reference P/D
proxy's prefill request is what vLLM's proxy sends."""

from __future__ import annotations

import asyncio
import http.server
import sys
import threading
from pathlib import Path

import aiohttp
import httpx
import pytest

from engine_hooks import trace_proxy
from engine_hooks.asgi import parse_traceparent

ROOT = Path(__file__).resolve().parents[2]
CALLER = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


@pytest.fixture(autouse=True)
def no_export(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")  # the proxy's spans: recorded, sent nowhere


@pytest.fixture
def backend():
    """A real HTTP server on loopback that answers every GET with 200 and keeps each request's
    traceparent header (None without one)."""
    seen: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("traceparent"))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    srv.shutdown()


def proxy_app(url: str):
    """An ASGI proxy that calls ``url`` four ways per request: httpx async, httpx sync, aiohttp,
    and httpx async with a traceparent of its own."""

    async def app(scope, receive, send):
        async with httpx.AsyncClient() as c:
            await c.get(url)
            await c.get(url, headers={"traceparent": CALLER})
        with httpx.Client() as c:
            c.get(url)
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            await r.read()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    return app


async def serve_one(app, headers: list[tuple[bytes, bytes]]) -> int:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/v1/completions", "headers": headers}
    await app(scope, receive, send)
    return sent[0]["status"]


def test_the_backend_calls_carry_the_proxys_span_as_parent(backend):
    url, seen = backend
    app = trace_proxy(proxy_app(url))
    assert asyncio.run(serve_one(app, [(b"traceparent", CALLER.encode())])) == 200
    assert len(seen) == 4
    own = seen.pop(1)
    assert own == CALLER  # set by the caller itself: kept
    parsed = [parse_traceparent(h) for h in seen]
    assert None not in parsed
    caller = parse_traceparent(CALLER)
    assert {p[0] for p in parsed} == {caller[0]}  # the client's trace
    assert {p[1] for p in parsed} != {caller[1]} and len({p[1] for p in parsed}) == 1  # one span: the proxy's


def test_a_request_without_a_caller_starts_a_trace_that_its_backend_calls_join(backend):
    url, seen = backend
    asyncio.run(serve_one(trace_proxy(proxy_app(url)), []))
    parsed = [parse_traceparent(h) for h in seen if h != CALLER]
    assert len(parsed) == 3 and None not in parsed and len({p[:2] for p in parsed}) == 1


def test_calls_outside_a_served_request_get_no_traceparent(backend):
    url, seen = backend
    trace_proxy(proxy_app(url))  # the clients are hooked from here on
    httpx.get(url)

    async def alone():
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            await r.read()

    asyncio.run(alone())
    assert seen == [None, None]


def test_the_reference_proxy_sends_the_prefill_leg_what_vllms_proxy_sends():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from pd_proxy import prefill_body
    finally:
        sys.path.remove(str(ROOT / "examples"))
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    body["min_tokens"] = 3
    p = prefill_body(body)
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p and "min_tokens" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True and p["kv_transfer_params"]["do_remote_prefill"] is False
    assert body["max_tokens"] == 50 and body["min_tokens"] == 3  # the decode leg gets the original
