"""OTLP/HTTP trace receiver: ``POST /v1/traces`` with ``application/x-protobuf`` or
``application/json`` bodies, optionally ``Content-Encoding: gzip``. Answers in the request's
encoding: 200 with an ``ExportTraceServiceResponse`` (``partial_success`` only when spans were
rejected), 400 with a ``google.rpc.Status`` for malformed data, 413 over the size limit, 415 for
other content types, 401 without the bearer token, 503 with ``Retry-After`` under overload.

The connections are read on an event loop (:mod:`collector.receivers.http_loop`): many idle or
slow senders cost a buffer each, not a thread, and one peer address holds at most
``--max-connections-per-peer`` of them. What to answer is decided here, from the head alone where
it can be (:meth:`OtlpHttp.early`: 404, 411, 413, 401 before a body is read) and with the body on a
worker thread (:meth:`OtlpHttp.handle`).
"""

from __future__ import annotations

import json
import resource
import ssl

from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from ..config import ReceiverSettings
from .http_loop import Answer, Limits, LoopServer, Request, bind
from .intake import DecodeError, Intake, Overloaded, PayloadTooLarge, ReceiverCounters, token_matches

PATH = "/v1/traces"
METRICS_PATH = "/v1/metrics"  # the traced processes' own cost (collector.receivers.tracer_cost)


#: bodies being read at once, at most this many times --max-message-bytes (the bytes buffered
#: across connections; a request that would go past it is answered 503, retryable)
READING_MESSAGES = 64
QUICK_BYTES = 1 << 20


def _status(code: int, http_code: int, message: str, as_json: bool, extra=None, close: bool = False) -> Answer:
    if as_json:
        body, ctype = json.dumps({"code": code, "message": message}).encode(), "application/json"
    else:
        body, ctype = status_pb2.Status(code=code, message=message).SerializeToString(), "application/x-protobuf"
    return Answer(http_code, body, ctype, dict(extra or {}), close)


class OtlpHttp:
    """What the OTLP/HTTP receiver answers: :meth:`early` from a request's head, :meth:`handle`
    with its body."""

    def __init__(self, intake: Intake, settings: ReceiverSettings, counters: ReceiverCounters):
        self.intake, self.settings, self.counters = intake, settings, counters

    def early(self, req: Request) -> Answer | None:
        ctype = (req.headers.get("content-type") or "").split(";")[0].strip().lower()
        as_json = ctype == "application/json"
        if req.method != "POST":
            return _status(12, 405, f"{req.method} is not served; POST to {PATH}", as_json, {"Allow": "POST"}, True)
        if req.path not in (PATH, METRICS_PATH):
            return _status(5, 404, f"unknown path {req.path}; traces go to {PATH}", as_json, close=True)
        length = req.headers.get("content-length")
        if length is None or not (length.isascii() and length.isdigit()):  # "²".isdigit() is True
            return _status(3, 411, "Content-Length required", as_json, close=True)
        n, limit = int(length), self.settings.max_message_bytes
        if n > limit:
            return _status(8, 413, f"body of {n} bytes is over the {limit}-byte limit", as_json, close=True)
        token = self.settings.auth_token
        if token and not token_matches(req.headers.get("authorization"), token):  # before the body
            self.counters.unauthenticated += 1
            return _status(16, 401, "missing or wrong bearer token", as_json, {"WWW-Authenticate": "Bearer"}, True)
        return None

    @staticmethod
    def quick(req: Request) -> bool:
        """Answered on the receiver's loop thread: protobuf bodies up to ``QUICK_BYTES`` (a JSON
        body, or a large one, goes to a worker thread: the loop keeps reading meanwhile)."""
        return len(req.body) <= QUICK_BYTES and "json" not in req.headers.get("content-type", "")

    def handle(self, req: Request) -> Answer:
        ctype = (req.headers.get("content-type") or "").split(";")[0].strip().lower()
        as_json = ctype == "application/json"
        if ctype not in ("application/x-protobuf", "application/json"):
            msg = f"unsupported Content-Type {ctype!r}: use application/x-protobuf or application/json"
            return _status(3, 415, msg, as_json)
        enc = (req.headers.get("content-encoding") or "").strip().lower()
        if enc not in ("", "identity", "gzip"):
            return _status(3, 415, f"unsupported Content-Encoding {enc!r}", as_json)
        reply_type = "application/json" if as_json else "application/x-protobuf"
        try:
            if req.path == METRICS_PATH:
                reply = self.intake.accept_metrics(req.body, json_body=as_json, gzipped=enc == "gzip")
                return Answer(200, reply, reply_type)
            res = self.intake.accept(req.body, json_body=as_json, gzipped=enc == "gzip")
        except PayloadTooLarge as exc:
            if req.path != METRICS_PATH:
                self.counters.payloads_invalid += 1
            return _status(8, 413, str(exc), as_json)
        except DecodeError as exc:
            if req.path != METRICS_PATH:
                self.counters.payloads_invalid += 1
            return _status(3, 400, str(exc), as_json)
        except Overloaded as exc:
            retry = {"Retry-After": str(Overloaded.retry_after_s)}
            return _status(14, 503, f"collector overloaded: {exc}; retry later", as_json, retry)
        resp = ExportTraceServiceResponse()
        if res.rejected:
            resp.partial_success.rejected_spans = res.rejected
            resp.partial_success.error_message = res.message or "spans rejected"
        if as_json:
            return Answer(200, json_format.MessageToJson(resp).encode(), reply_type)
        return Answer(200, resp.SerializeToString(), reply_type)


class HttpReceiver:
    def __init__(self, intake: Intake, settings: ReceiverSettings, counters: ReceiverCounters, host: str, port: int):
        self.intake, self.settings, self.counters = intake, settings, counters
        _room_for_connections(settings.max_connections)
        sock = bind(host, port, "OTLP/HTTP receiver")
        ctx = None
        if settings.tls_cert and settings.tls_key:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
        limits = Limits(
            max_connections=settings.max_connections,
            max_per_peer=settings.max_connections_per_peer,
            read_timeout_s=settings.read_timeout_s,
            request_timeout_s=settings.request_timeout_s,
            max_buffered_bytes=READING_MESSAGES * settings.max_message_bytes,
        )
        otlp = OtlpHttp(intake, settings, counters)
        self.server = LoopServer(sock, limits, counters, otlp.early, otlp.handle, ctx, quick=otlp.quick)
        self.address = sock.getsockname()

    def start(self) -> HttpReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()


def _room_for_connections(n: int) -> None:
    """Raise the soft limit on open files toward what ``n`` connections need (the hard limit caps it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            room = want if hard == resource.RLIM_INFINITY else min(want, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (room, hard))
        except (ValueError, OSError):
            pass
