"""HTTP/1.1 on an event loop, for the OTLP/HTTP receiver: one thread reads every connection's
requests (an idle or slow connection costs a buffer, not a thread), a small pool of worker threads
answers them. What it bounds, whatever the senders do:

* connections open at once (``max_connections``) and per peer address (``max_per_peer``): the
  next is answered 503 with ``Retry-After`` and closed (counted ``connections_refused``);
* each read waits at most ``read_timeout_s``, a whole request (head and body, from the first
  wait for it) at most ``request_timeout_s``: then the connection is closed (counted
  ``requests_timed_out`` when part of a request had come);
* the head at most ``MAX_HEAD_BYTES`` (431), the bytes buffered across connections at most
  ``max_buffered_bytes`` (503, retryable): a request's body is read as it arrives, never reserved.

What a request gets is the caller's: ``early(request)`` answers from the head alone (or None to
read the body), ``handle(request)`` answers with the body: on the loop's thread when
``quick(request)`` says it is (a hand-off to a worker and back cost a quarter of the intake rate
with small bodies), else on a worker thread, the loop reading the other connections meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("collector")

MAX_HEAD_BYTES = 64 << 10
#: the TLS handshake in each connection's own task (Python 3.11's StreamWriter.start_tls), where a
#: failed one is counted; on 3.10 asyncio's server does it
_TLS_PER_CONNECTION = hasattr(asyncio.StreamWriter, "start_tls")
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    500: "Internal Server Error",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


@dataclass
class Request:
    method: str
    path: str  # without the query
    headers: dict[str, str]  # lowercased names; the first of a repeated header
    body: bytes = b""


@dataclass
class Answer:
    status: int
    body: bytes = b""
    content_type: str = "application/x-protobuf"
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False

    def wire(self) -> bytes:
        head = [f"HTTP/1.1 {self.status} {_REASONS.get(self.status, 'Error')}"]
        head.append(f"Content-Type: {self.content_type}")
        head.append(f"Content-Length: {len(self.body)}")
        head.extend(f"{k}: {v}" for k, v in self.headers.items())
        if self.close:
            head.append("Connection: close")
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + self.body


@dataclass
class Limits:
    max_connections: int
    max_per_peer: int
    read_timeout_s: float
    request_timeout_s: float
    max_buffered_bytes: int


class _Timeout(Exception):
    pass


class LoopServer:
    """Serves ``sock`` (bound and listening) on an event loop thread of its own."""

    def __init__(
        self,
        sock: socket.socket,
        limits: Limits,
        counters,
        early: Callable[[Request], Answer | None],
        handle: Callable[[Request], Answer],
        ssl_context: ssl.SSLContext | None = None,
        workers: int = 4,
        name: str = "otlp-http",
        quick: Callable[[Request], bool] = lambda req: False,
    ):
        self.sock, self.limits, self.counters = sock, limits, counters
        self.early, self.handle, self.ssl_context, self.quick = early, handle, ssl_context, quick
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name)
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._loop_error)
        self._open = 0
        self._per_peer: dict[str, int] = {}
        self._buffered = 0  # bytes read and not yet taken, across connections
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # -- life ------------------------------------------------------------------------------------
    def start(self) -> LoopServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(30)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _listen(self) -> None:
        tls_here = self.ssl_context is not None and not _TLS_PER_CONNECTION  # Python 3.10: asyncio's handshake
        self._server = await asyncio.start_server(
            self._connection,
            sock=self.sock,
            ssl=self.ssl_context if tls_here else None,
            ssl_handshake_timeout=self.limits.read_timeout_s if tls_here else None,
            limit=MAX_HEAD_BYTES,
        )

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:  # connections ending: their tasks finish here, not with the loop
                t.cancel()
            await asyncio.wait(tasks, timeout=5) if tasks else None

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        self.pool.shutdown(wait=False)
        self.sock.close()

    def _loop_error(self, loop, context: dict) -> None:
        """A TLS handshake that failed or timed out, a peer gone: counted or ignored, not printed."""
        exc = context.get("exception")
        if isinstance(exc, ssl.SSLError | TimeoutError | ConnectionError):
            if self.ssl_context is not None and not _TLS_PER_CONNECTION:
                self.counters.tls_handshakes_failed += 1
            return
        loop.default_exception_handler(context)

    # -- a connection ----------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = (writer.get_extra_info("peername") or ("?",))[0]
        lim = self.limits
        if self._open >= lim.max_connections or self._per_peer.get(peer, 0) >= lim.max_per_peer:
            self.counters.connections_refused += 1
            writer.write(_BUSY)
            await self._close(writer)
            return
        self._open += 1
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        self._writers.add(writer)
        held = [0]  # this connection's share of _buffered
        try:
            if self.ssl_context is not None and _TLS_PER_CONNECTION:
                try:  # in the connection's slot, within the read timeout: a silent client holds one slot
                    await writer.start_tls(self.ssl_context, ssl_handshake_timeout=self.limits.read_timeout_s)
                except (ssl.SSLError, TimeoutError, ConnectionError, OSError):
                    self.counters.tls_handshakes_failed += 1
                    return
            await self._serve(reader, writer, held)
        except (ConnectionError, OSError, ssl.SSLError, asyncio.IncompleteReadError):
            pass  # the peer went away
        finally:
            self._buffered -= held[0]
            self._open -= 1
            n = self._per_peer[peer] - 1
            if n:
                self._per_peer[peer] = n
            else:
                del self._per_peer[peer]
            self._writers.discard(writer)
            await self._close(writer)

    async def _close(self, writer: asyncio.StreamWriter) -> None:
        try:
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (OSError, ssl.SSLError, TimeoutError, asyncio.CancelledError):
            writer.transport.abort()

    async def _read(self, reader: asyncio.StreamReader, deadline: float) -> bytes:
        """The next bytes (b"" at the end of the stream), within the read timeout and the deadline."""
        left = min(self.limits.read_timeout_s, deadline - self.loop.time())
        if left <= 0:
            raise _Timeout
        try:
            return await asyncio.wait_for(reader.read(1 << 16), left)
        except TimeoutError:
            raise _Timeout from None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, held: list[int]) -> None:
        buf = bytearray()

        def take(n: int) -> bytes:
            out = bytes(buf[:n])
            del buf[:n]
            self._buffered -= n
            held[0] -= n
            return out

        async def more(deadline: float) -> bool:
            chunk = await self._read(reader, deadline)
            if not chunk:
                return False
            buf.extend(chunk)
            self._buffered += len(chunk)
            held[0] += len(chunk)
            return True

        while True:
            deadline = self.loop.time() + self.limits.request_timeout_s
            try:
                while (end := buf.find(b"\r\n\r\n")) < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        await self._answer(writer, Answer(431, b"", "text/plain", close=True))
                        return
                    if not await more(deadline):
                        return  # closed between requests (or mid-head)
                req = _parse_head(take(end + 4)[:-4])
                if req is None:
                    await self._answer(writer, Answer(400, b"malformed request head", "text/plain", close=True))
                    return
                answer = self.early(req)
                if answer is not None:
                    await self._answer(writer, answer)
                    if answer.close:
                        return
                    continue
                n = int(req.headers["content-length"])  # early() checked it
                while len(buf) < n:
                    if self._buffered > self.limits.max_buffered_bytes:
                        await self._answer(writer, Answer(503, b"", "text/plain", {"Retry-After": "1"}, close=True))
                        return
                    if not await more(deadline):
                        got = len(buf)
                        msg = f"body ended after {got} of {n} bytes".encode()
                        await self._answer(writer, Answer(400, msg, "text/plain", close=True))
                        return
                req.body = take(n)
            except _Timeout:
                if buf or held[0]:
                    self.counters.requests_timed_out += 1
                return
            try:
                if self.quick(req):  # on this thread: no hand-off to wait for
                    answer = self.handle(req)
                else:  # on a worker: the loop goes on reading the others meanwhile
                    answer = await self.loop.run_in_executor(self.pool, self.handle, req)
            except Exception:  # a defect in handle(): said, answered 500, the server goes on
                log.exception("collector: answering an OTLP/HTTP request failed")
                answer = Answer(500, b"", "text/plain", close=True)
            await self._answer(writer, answer)
            if answer.close:
                return

    async def _answer(self, writer: asyncio.StreamWriter, answer: Answer) -> None:
        writer.write(answer.wire())
        try:  # a peer that never reads its answer holds the connection no longer than a read
            await asyncio.wait_for(writer.drain(), self.limits.read_timeout_s)
        except TimeoutError:
            writer.transport.abort()


def _parse_head(head: bytes) -> Request | None:
    """The request line and headers; None when they do not parse as HTTP/1.x."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            return None
        headers.setdefault(name.decode("latin-1").lower(), value.strip().decode("latin-1"))
    target = parts[1].decode("latin-1")
    return Request(parts[0].decode("latin-1"), target.split("?")[0], headers)


def bind(host: str, port: int, what: str, backlog: int = 1024) -> socket.socket:
    """A listening socket; an address that cannot be bound is an OSError that names the listener
    and the address (not only "Address already in use")."""
    try:
        return socket.create_server((host, port), backlog=backlog)
    except OSError as exc:
        raise OSError(exc.errno, f"{what} cannot listen on {host}:{port}: {exc.strerror or exc}") from None
