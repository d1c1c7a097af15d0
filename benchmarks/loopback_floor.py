"""The floor of ``network_in`` on this machine: client send -> server's first byte read, over
loopback, with nothing but a trivial app behind uvicorn (httptools and uvloop, as vLLM's API server
runs) and httpx as the client. The same two stamps as a traced request: httpcore's
``send_request_headers.started`` (otel_llm's client) and uvicorn's message-begin callback
(:func:`engine_hooks.asgi.instrument_uvicorn`). Whatever this prints is the part of a traced
server's ``network_in`` no server can remove on this host: the kernel's loopback, and the time
the server's event loop takes to wake for readable bytes.

    .venv/bin/python benchmarks/loopback_floor.py [--requests 400] [--rate 20]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import numpy as np

SERVER = """
import sys, uvicorn
from engine_hooks.asgi import FIRST_BYTE, instrument_uvicorn
instrument_uvicorn()
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = str(scope.get(FIRST_BYTE, 0)).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), http="httptools", loop="uvloop", log_level="warning")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="requests measured (after 20 of warm-up)")
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second, one at a time (0: back to back)")
    args = ap.parse_args()
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], cwd=root)
    try:
        url = f"http://127.0.0.1:{port}/"
        with httpx.Client(timeout=10) as client:
            for _ in range(100):
                try:
                    client.get(url)
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            sent: list[int] = []

            def trace(name: str, info: dict) -> None:
                if name == "http11.send_request_headers.started":
                    sent.append(time.monotonic_ns())

            gaps = []
            for i in range(20 + args.requests):
                sent.clear()
                r = client.post(url, content=b'{"prompt": "w1 w2"}', extensions={"trace": trace})
                if i >= 20:
                    gaps.append(int(r.text) - sent[-1])
                if args.rate > 0:
                    time.sleep(1 / args.rate)
    finally:
        server.terminate()
        server.wait(10)
    us = np.array(gaps) / 1e3
    pace = f"at {args.rate:g}/s" if args.rate > 0 else "back to back"
    print(
        f"network_in floor (httpx send -> uvicorn/httptools first byte, loopback, {len(us)} requests {pace}): "
        f"p50 {np.median(us):.0f} us, p10 {np.percentile(us, 10):.0f} us, "
        f"p90 {np.percentile(us, 90):.0f} us, min {us.min():.0f} us"
    )


if __name__ == "__main__":
    main()
