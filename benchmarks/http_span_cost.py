"""Benchmark: what the HTTP server span costs uvicorn's event loop, in instructions (callgrind).

``engine_hooks.asgi.TracingMiddleware`` runs on the thread that serves every request, so its work
a request and a streamed chunk is what it takes from the server. This counts it in isolation,
without an engine: uvicorn's own ``RequestResponseCycle`` (httptools' framing, its flow control)
drives an app that streams ``--chunks`` SSE-sized body chunks per response, into a transport whose
``write`` is a C method as uvloop's is, ``--requests`` responses per count. Three ways:

* ``plain``: the app alone;
* ``send``: traced, the app's ``send`` wrapped (``_hotpath.TimedSend``: any ASGI server);
* ``transport``: traced, the connection's transport timed (``_hotpath.TimedTransport``: what the
  middleware does under uvicorn, where the app gets uvicorn's own ``send``).

Each is counted with no chunk and with ``--chunks``; what tracing adds a request is the first
against plain, a chunk the difference between the two over ``--chunks``. One process under
``valgrind --tool=callgrind`` with counting off; the parent switches it on around each count
(``callgrind_control``), as ``benchmarks/cost_count.py`` does for the engines. The cyclic garbage
collector is off in the counted process: a collection falls in one count or another by
allocation count, not by the code counted. Under a minute.

Run: ``.venv/bin/python benchmarks/http_span_cost.py [--requests 50] [--chunks 64]``. Needs
valgrind (``make valgrind``).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import counted

MODES = ("plain", "send", "transport")


def drive() -> None:
    """The counted process (:mod:`counted`): one line ``GO <mode> <chunks> <requests>`` on stdin
    per count, answered ``DONE`` when its responses have been written."""
    import asyncio
    import collections
    import gc
    import logging

    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    from engine_hooks.asgi import FIRST_BYTE, TIMED_TRANSPORT, TracingMiddleware
    from engine_hooks.hot_path import _hotpath
    from engine_hooks.hot_path.recorder import Recorder
    from otel_llm.clock import monotonic_ns

    class Transport:
        """What uvicorn's cycle uses of a transport; ``write`` a C method, as uvloop's is."""

        def __init__(self):
            self.write = collections.deque(maxlen=1).append

        def is_closing(self) -> bool:
            return False

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

        def get_extra_info(self, name, default=None):
            return default

    chunks = 0

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(chunks):
            await send({"type": "http.response.body", "body": b'data: {"text": "x"}\n\n', "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    traced = TracingMiddleware(app, recorder=Recorder(1 << 30))
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"user-agent", b"python-httpx/0.27"),
        (b"accept", b"*/*"),
        (b"content-type", b"application/json"),
        (b"content-length", b"200"),
        (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    ]
    log = logging.getLogger("http_span_cost")
    raw = Transport()
    timed = _hotpath.TimedTransport(raw)  # one connection's, made once: a kept-alive connection

    async def responses(mode: str, n: int) -> None:
        transport = timed if mode == "transport" else raw
        for _ in range(n):
            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "server": ("127.0.0.1", 8000),
                "client": ("127.0.0.1", 50000),
                "scheme": "http",
                "method": "POST",
                "root_path": "",
                "path": "/v1/completions",
                "raw_path": b"/v1/completions",
                "query_string": b"",
                "headers": headers,
                "state": {},
                FIRST_BYTE: monotonic_ns(),
            }
            if mode == "transport":
                scope[TIMED_TRANSPORT] = timed
            cycle = RequestResponseCycle(
                scope,
                transport,
                FlowControl(transport),
                log,
                log,
                False,
                [],
                asyncio.Event(),
                False,
                True,
                lambda: None,
            )
            await cycle.run_asgi(app if mode == "plain" else traced)

    loop = asyncio.new_event_loop()
    gc.disable()
    for mode in MODES:  # warm: every code path specialized before it is counted
        chunks = 4
        loop.run_until_complete(responses(mode, 3))
    print("READY", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "GO":
            break
        mode, chunks, n = parts[1], int(parts[2]), int(parts[3])
        loop.run_until_complete(responses(mode, n))
        print("DONE", flush=True)


def added(counts: dict[tuple[str, int], int], requests: int, chunks: int) -> dict[str, tuple[float, float]]:
    """What each traced way adds over plain: (instructions a request, instructions a chunk)."""
    out = {}
    for mode in MODES[1:]:
        per_request = (counts[mode, 0] - counts["plain", 0]) / requests
        streamed = (counts[mode, chunks] - counts["plain", chunks]) / requests
        out[mode] = (per_request, (streamed - per_request) / chunks)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = counted.parser(__doc__)
    ap.add_argument("--requests", type=int, default=50, help="responses per count (default 50)")
    ap.add_argument("--chunks", type=int, default=64, help="body chunks per streamed response (default 64)")
    args = ap.parse_args(argv)
    if args.drive:
        drive()
        return 0

    env = dict(os.environ)
    env.pop("OTEL_LLM_PURE_PYTHON", None)
    steps = [(mode, chunks) for mode in MODES for chunks in (0, args.chunks)]
    totals = counted.count_steps(__file__, [f"{mode} {chunks} {args.requests}" for mode, chunks in steps], env)
    counts = dict(zip(steps, totals, strict=True))
    print(f"\nwhat the HTTP server span adds over plain ({args.requests} responses, {args.chunks} chunks each):\n")
    print("| timed at | instructions a request | instructions a chunk |")
    print("|---|---|---|")
    names = {"send": "the app's send (TimedSend)", "transport": "the connection's transport (TimedTransport)"}
    for mode, (per_request, per_chunk) in added(counts, args.requests, args.chunks).items():
        print(f"| {names[mode]} | {per_request / 1000:.1f} k | {per_chunk:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
