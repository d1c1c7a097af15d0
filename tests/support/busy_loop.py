"""An ASGI middleware for tests that makes an API server busy on purpose: a request to
``/busy?ms=N`` holds the server's event loop for N ms (``time.sleep`` inside the coroutine, as a
synchronous handler, a CPU-heavy parse or a blocking call would) and answers 200. Every other
request passes through. vLLM's server takes it as ``--middleware busy_loop.BlockTheLoop`` with this
folder on ``PYTHONPATH``."""

from __future__ import annotations

import time
import urllib.parse


class BlockTheLoop:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http" and scope.get("path") == "/busy":
            query = urllib.parse.parse_qs(scope.get("query_string", b"").decode())
            time.sleep(int(query.get("ms", ["300"])[0]) / 1e3)  # the loop runs nothing else meanwhile
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"busy\n"})
            return
        await self.app(scope, receive, send)
