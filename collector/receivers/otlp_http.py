"""OTLP/HTTP trace receiver: ``POST /v1/traces`` with ``application/x-protobuf`` or
``application/json`` bodies, optionally ``Content-Encoding: gzip``. Answers in the request's
encoding: 200 with an ``ExportTraceServiceResponse`` (``partial_success`` only when spans were
rejected), 400 with a ``google.rpc.Status`` for malformed data, 413 over the size limit, 415 for
other content types, 401 without the bearer token, 503 with ``Retry-After`` under overload.
"""

from __future__ import annotations

import itertools
import json
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from ..config import ReceiverSettings, listen
from ..tls import HandshakeInThread, is_handshake_failure, wrap_listener
from .intake import DecodeError, Intake, Overloaded, PayloadTooLarge, ReceiverCounters, token_matches

PATH = "/v1/traces"
METRICS_PATH = "/v1/metrics"  # the traced processes' own cost (collector.receivers.tracer_cost)


_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class Deadlines:
    """One watchdog thread for every connection's request deadline: a connection whose request
    has not arrived whole by its deadline has its socket shut down (the handler's blocked read
    ends, the slot is freed) and is counted. Deadlines cover reading only, never the processing
    of a request or the writing of its answer. At most one per connection is live (bounded by
    ``--max-connections``); they are checked every ``period_s``."""

    def __init__(self, counters: ReceiverCounters, period_s: float = 0.25):
        self.counters, self.period_s = counters, period_s
        self._live: dict[int, tuple[float, socket.socket]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="otlp-http-deadlines", daemon=True)
        self._thread.start()

    def arm(self, sock: socket.socket, seconds: float) -> int:
        with self._lock:
            key = next(self._ids)
            self._live[key] = (time.monotonic() + seconds, sock)
            return key

    def disarm(self, key: int) -> bool:
        """False when the deadline had already passed (the socket is shut down)."""
        with self._lock:
            return self._live.pop(key, None) is not None

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            now = time.monotonic()
            with self._lock:
                due = [k for k, (at, _) in self._live.items() if at <= now]
                socks = [self._live.pop(k)[1] for k in due]
            for sock in socks:
                self.counters.requests_timed_out += 1
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once: the next is answered 503 with
    ``Retry-After`` and closed (held connections cannot take the process's memory or threads)."""

    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: a burst of new connections is answered, not reset

    def set_bound(self, max_connections: int, counters: ReceiverCounters) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.counters = counters

    def handle_error(self, request, client_address):
        """A TLS handshake that failed or timed out (in the connection's own thread) is counted,
        not printed; anything else is reported as socketserver does."""
        import sys

        if is_handshake_failure(sys.exc_info()[1]):  # or a peer gone mid-answer: nothing to report
            if isinstance(request, ssl.SSLSocket):
                self.counters.tls_handshakes_failed += 1
            return
        super().handle_error(request, client_address)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.counters.connections_refused += 1
            try:
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class HttpReceiver:
    def __init__(self, intake: Intake, settings: ReceiverSettings, counters: ReceiverCounters, host: str, port: int):
        self.intake, self.settings, self.counters = intake, settings, counters
        self.deadlines = Deadlines(counters)
        handler = self._handler_class()
        self.server = listen(_BoundedServer, host, port, handler, "OTLP/HTTP receiver")
        self.server.set_bound(settings.max_connections, counters)
        self.server.daemon_threads = True
        cfg = settings
        if cfg.tls_cert and cfg.tls_key:  # the handshake in each connection's thread, with the read timeout
            wrap_listener(self.server, cfg.tls_cert, cfg.tls_key)
        self.address = self.server.server_address
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-http", daemon=True)

    def _handler_class(self):
        intake, settings, counters, deadlines = self.intake, self.settings, self.counters, self.deadlines

        class Handler(HandshakeInThread, BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = settings.read_timeout_s  # every read of the socket: a held body cannot pin a thread

            def log_message(self, *a):
                pass

            def handle_one_request(self):
                # the whole request (request line, headers, body) within --request-timeout
                self._deadline = deadlines.arm(self.connection, settings.request_timeout_s)
                try:
                    super().handle_one_request()
                finally:
                    deadlines.disarm(self._deadline)

            def _reply(self, code: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _status(self, code: int, http_code: int, message: str, as_json: bool, extra=None) -> None:
                st = status_pb2.Status(code=code, message=message)
                if as_json:
                    self._reply(
                        http_code, json.dumps({"code": code, "message": message}).encode(), "application/json", extra
                    )
                else:
                    self._reply(http_code, st.SerializeToString(), "application/x-protobuf", extra)

            def do_POST(self):
                ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
                as_json = ctype == "application/json"
                length = self.headers.get("Content-Length")
                path = self.path.split("?")[0]
                if path not in (PATH, METRICS_PATH):
                    self.close_connection = True
                    self._status(5, 404, f"unknown path {self.path}; traces go to {PATH}", as_json)
                    return
                if length is None or not (length.isascii() and length.isdigit()):  # "²".isdigit() is True
                    self.close_connection = True
                    self._status(3, 411, "Content-Length required", as_json)
                    return
                n = int(length)
                limit = settings.max_message_bytes
                if n > limit:
                    self.close_connection = True
                    self._status(8, 413, f"body of {n} bytes is over the {limit}-byte limit", as_json)
                    return
                token = settings.auth_token
                if token and not token_matches(self.headers.get("Authorization"), token):  # before the body
                    counters.unauthenticated += 1
                    self.close_connection = True
                    self._status(16, 401, "missing or wrong bearer token", as_json, {"WWW-Authenticate": "Bearer"})
                    return
                try:
                    body = self.rfile.read(n)
                except TimeoutError:  # a client that holds its body back: the connection goes
                    self.close_connection = True
                    return
                if not deadlines.disarm(self._deadline):  # too late: the connection is shut down
                    self.close_connection = True
                    return
                if len(body) < n:  # arrived: processing and answering are not bounded by the deadline
                    self.close_connection = True
                    self._status(3, 400, f"body ended after {len(body)} of {n} bytes", as_json)
                    return
                if ctype not in ("application/x-protobuf", "application/json"):
                    self._status(
                        3,
                        415,
                        f"unsupported Content-Type {ctype!r}: use application/x-protobuf or application/json",
                        as_json,
                    )
                    return
                enc = (self.headers.get("Content-Encoding") or "").strip().lower()
                if enc not in ("", "identity", "gzip"):
                    self._status(3, 415, f"unsupported Content-Encoding {enc!r}", as_json)
                    return
                if path == METRICS_PATH:
                    try:
                        reply = intake.accept_metrics(body, json_body=as_json, gzipped=enc == "gzip")
                    except PayloadTooLarge as exc:
                        self._status(8, 413, str(exc), as_json)
                        return
                    except DecodeError as exc:
                        self._status(3, 400, str(exc), as_json)
                        return
                    self._reply(200, reply, "application/json" if as_json else "application/x-protobuf")
                    return
                try:
                    res = intake.accept(body, json_body=as_json, gzipped=enc == "gzip")
                except PayloadTooLarge as exc:
                    counters.payloads_invalid += 1
                    self._status(8, 413, str(exc), as_json)
                    return
                except DecodeError as exc:
                    counters.payloads_invalid += 1
                    self._status(3, 400, str(exc), as_json)
                    return
                except Overloaded as exc:
                    self._status(
                        14,
                        503,
                        f"collector overloaded: {exc}; retry later",
                        as_json,
                        {"Retry-After": str(Overloaded.retry_after_s)},
                    )
                    return
                resp = ExportTraceServiceResponse()
                if res.rejected:
                    resp.partial_success.rejected_spans = res.rejected
                    resp.partial_success.error_message = res.message or "spans rejected"
                if as_json:
                    self._reply(200, json_format.MessageToJson(resp).encode(), "application/json")
                else:
                    self._reply(200, resp.SerializeToString(), "application/x-protobuf")

        return Handler

    def start(self) -> HttpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
