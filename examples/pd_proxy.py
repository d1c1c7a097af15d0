"""A reference proxy for disaggregated prefill and decode with vLLM, traced with one call.

It does what vLLM's own P/D proxy does (``toy_proxy_server.py``, among the tests of vLLM's
repository): each completion or chat request goes first to a prefill server with
``max_tokens=1``, not streamed, and ``kv_transfer_params.do_remote_decode=true`` (the prefill
engine computes the prompt and keeps its KV blocks for the decode side); the ``kv_transfer_params``
it answers with (its request id, engine id, blocks, host and port) go with the original request to
a decode server, whose answer, streamed or not, is the client's. Both legs get one
``X-Request-Id``, as vLLM's proxy sends: the client's own where it sent one (vLLM's ``bench serve``
does, and joins its results by it), else a new one.

What it adds is one line: ``app = trace_proxy(app)`` (:func:`engine_hooks.trace_proxy`). Each
request then has the proxy's server span, and both legs carry its ``traceparent``: the prefill and
decode engines' spans land in the client's trace, and the collector joins them into one request
(``pd_role = disaggregated``). Spans go where the standard ``OTEL_*`` variables say.

    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Errors are the proxy's own, as a client would expect them from a server: a prefill or decode
server that cannot be reached or answers with an error gives a 502 with an OpenAI-style error body
(``"type": "proxy_error"``), naming which leg failed; the backend's own 4xx passes through.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import uuid
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

#: OpenAI request fields the prefill leg does not take (vLLM's proxy drops them there, keeps them for decode)
_DECODE_ONLY = ("min_tokens", "min_completion_tokens", "stream_options")


def _error(status: int, message: str, leg: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "proxy_error", "code": status, "param": leg}}, status_code=status
    )


def prefill_body(body: dict) -> dict:
    """The request the prefill server gets: one token, not streamed, KV kept for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _DECODE_ONLY}
    out.update(
        stream=False,
        max_tokens=1,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def build_app(prefill: list[str], decode: list[str], trace: bool = True):
    """The proxy's ASGI app: ``prefill`` and ``decode`` are the servers' base URLs (round robin
    over each list); ``trace``: wrapped by :func:`engine_hooks.trace_proxy`."""
    clients: dict[str, list[httpx.AsyncClient]] = {}

    @asynccontextmanager
    async def lifespan(app):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        for leg, urls in (("prefill", prefill), ("decode", decode)):
            clients[leg] = [httpx.AsyncClient(base_url=u.rstrip("/"), timeout=None, limits=limits) for u in urls]
        yield
        for c in itertools.chain(*clients.values()):
            await c.aclose()

    app = FastAPI(lifespan=lifespan)
    turn = {"prefill": itertools.count(), "decode": itertools.count()}

    def pick(leg: str) -> httpx.AsyncClient:
        pool = clients[leg]
        return pool[next(turn[leg]) % len(pool)]

    async def handle(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON", "request")
        if not isinstance(body, dict):
            return _error(400, "the request body is not a JSON object", "request")
        # the client's request id, where it sent one (a load tool joins its results by it), else a new one
        headers = {"X-Request-Id": request.headers.get("x-request-id") or str(uuid.uuid4())}
        if request.headers.get("authorization"):
            headers["Authorization"] = request.headers["authorization"]
        try:
            p = await pick("prefill").post(path, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"the prefill server did not answer: {type(exc).__name__}: {exc}", "prefill")
        if p.status_code != 200:
            if 400 <= p.status_code < 500:  # the request's own fault: the client sees the server's answer
                return Response(p.content, p.status_code, media_type=p.headers.get("content-type"))
            return _error(502, f"the prefill server answered {p.status_code}: {p.text[:500]}", "prefill")
        kv = p.json().get("kv_transfer_params")
        if kv:
            body["kv_transfer_params"] = kv
        client = pick("decode")
        try:
            d = await client.send(client.build_request("POST", path, json=body, headers=headers), stream=True)
        except httpx.HTTPError as exc:
            return _error(502, f"the decode server did not answer: {type(exc).__name__}: {exc}", "decode")
        if d.status_code != 200:
            content = await d.aread()
            await d.aclose()
            if 400 <= d.status_code < 500:
                return Response(content, d.status_code, media_type=d.headers.get("content-type"))
            return _error(502, f"the decode server answered {d.status_code}: {content[:500]!r}", "decode")

        async def relay():
            try:
                async for chunk in d.aiter_raw():
                    yield chunk
            finally:
                await d.aclose()

        return StreamingResponse(relay(), media_type=d.headers.get("content-type", "application/json"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle("/v1/chat/completions", request)

    @app.get("/health")
    async def health():
        return {"prefill": prefill, "decode": decode}

    @app.get("/v1/models")
    async def models():
        r = await pick("decode").get("/v1/models")
        return Response(r.content, r.status_code, media_type="application/json")

    if not trace:
        return app
    from engine_hooks import trace_proxy

    return trace_proxy(app, service_name="pd-proxy")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="A disaggregated prefill/decode proxy for vLLM servers (what vLLM's toy proxy does), "
        "traced: its server span, and its traceparent on both legs (OTEL_* variables say where spans go).",
    )
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill servers' base URLs (http://host:port)")
    ap.add_argument("--decode", nargs="+", required=True, help="decode servers' base URLs (http://host:port)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--no-trace", action="store_true", help="serve untraced (a baseline to compare against)")
    args = ap.parse_args(argv)
    import uvicorn

    app = build_app(args.prefill, args.decode, trace=not args.no_trace)
    print(json.dumps({"proxy": f"http://{args.host}:{args.port}", "prefill": args.prefill, "decode": args.decode}))
    sys.stdout.flush()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
