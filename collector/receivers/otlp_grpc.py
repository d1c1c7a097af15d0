"""OTLP/gRPC trace receiver (``opentelemetry.proto.collector.trace.v1.TraceService/Export``).

The request arrives as raw bytes (no deserializer in grpc) so that a malformed payload is
answered INVALID_ARGUMENT with a message, not an internal error. Overload answers UNAVAILABLE
with a ``google.rpc.RetryInfo`` detail (what the OTLP exporters read to back off). Optional
bearer-token authentication and TLS.

The server is ``grpc.aio`` on an event loop thread of its own, and each Export is served as a
stream of messages, read by the handler itself. So:
* the bearer token is checked from the call's headers before its message is read: a sender
  without the token never has its message buffered (UNAUTHENTICATED at once);
* the message must arrive within ``read_timeout_s`` of the call (else DEADLINE_EXCEEDED): a call
  that sends headers and never its message costs a coroutine for that long, not a worker thread,
  so stalled calls cannot block the Export calls of others;
* at most ``max_calls`` calls at once (beyond, RESOURCE_EXHAUSTED from gRPC itself), so what the
  receiver holds is bounded by ``max_calls`` x ``--max-message-bytes``;
* the decoding and assembly (:meth:`Intake.accept`) run on ``workers`` threads.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from ..config import ReceiverSettings
from .intake import DecodeError, Intake, Overloaded, PayloadTooLarge, ReceiverCounters, token_matches

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
METRICS_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"  # the tracer's own cost


def retry_trailer(message: str, seconds: int) -> tuple:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=seconds)))
    st = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=message, details=[detail])
    return (("grpc-status-details-bin", st.SerializeToString()),)


class GrpcReceiver:
    def __init__(
        self,
        intake: Intake,
        settings: ReceiverSettings,
        counters: ReceiverCounters,
        host: str,
        port: int,
        workers: int = 4,
        max_calls: int = 64,
    ):
        self.intake, self.settings, self.counters = intake, settings, counters
        self.max_calls = max_calls
        self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="otlp-grpc")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="otlp-grpc-loop", daemon=True)
        self._thread.start()
        addr = f"{host}:{port}"
        try:
            self.port = asyncio.run_coroutine_threadsafe(self._build(addr), self._loop).result(30)
        except RuntimeError:  # grpc raises this when the port cannot be bound (older releases returned 0)
            self.port = 0
        if not self.port:
            self._close_loop()
            raise OSError(f"OTLP/gRPC receiver cannot listen on {addr} (in use, or not an address of this host)")
        self.address = (host, self.port)

    async def _build(self, addr: str) -> int:
        cfg = self.settings
        # no BDP probing: a stream whose message is not read (no token yet) buffers at most the initial
        # 64 KiB window, not a window grown to megabytes
        # and no SO_REUSEPORT (gRPC's default): a second collector on a taken port is refused, as
        # the HTTP and Prometheus ports are, not given half of the first one's connections
        opts = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.http2.bdp_probe", 0),
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.aio.server(options=opts, maximum_concurrent_rpcs=self.max_calls)
        traces = grpc.method_handlers_generic_handler(
            SERVICE, {"Export": grpc.stream_unary_rpc_method_handler(self._export)}
        )
        metrics = grpc.method_handlers_generic_handler(
            METRICS_SERVICE, {"Export": grpc.stream_unary_rpc_method_handler(self._export_metrics)}
        )
        self.server.add_generic_rpc_handlers((traces, metrics))
        if cfg.tls_cert and cfg.tls_key:
            with open(cfg.tls_key, "rb") as k, open(cfg.tls_cert, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
            return self.server.add_secure_port(addr, creds)
        return self.server.add_insecure_port(addr)

    async def _message(self, context) -> bytes:
        """The call's one message, after its token (headers) is checked; aborts the call otherwise."""
        token = self.settings.auth_token
        if token and not token_matches(dict(context.invocation_metadata()).get("authorization"), token):
            self.counters.unauthenticated += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        try:
            body = await asyncio.wait_for(context.read(), self.settings.read_timeout_s)
        except asyncio.TimeoutError:
            self.counters.payloads_invalid += 1
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no message within {self.settings.read_timeout_s} s"
            )
        if body is grpc.aio.EOF:
            self.counters.payloads_invalid += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no message")
        return body

    async def _export_metrics(self, _requests, context) -> bytes:
        body = await self._message(context)
        try:
            return await self._loop.run_in_executor(self._pool, self.intake.accept_metrics, body)
        except PayloadTooLarge as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _export(self, _requests, context) -> bytes:
        body = await self._message(context)
        try:
            res = await self._loop.run_in_executor(self._pool, self.intake.accept, body)
        except PayloadTooLarge as exc:
            self.counters.payloads_invalid += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DecodeError as exc:
            self.counters.payloads_invalid += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            context.set_trailing_metadata(retry_trailer(str(exc), Overloaded.retry_after_s))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"collector overloaded: {exc}; retry later")
        resp = ExportTraceServiceResponse()
        if res.rejected:
            resp.partial_success.rejected_spans = res.rejected
            resp.partial_success.error_message = res.message or "spans rejected"
        return resp.SerializeToString()

    def start(self) -> GrpcReceiver:
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(30)
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        """New calls are refused at once; calls in progress get ``grace_s`` to finish. Once: a
        second stop returns at once (its event loop is gone)."""
        if self._loop.is_closed() or not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self._loop).result(grace_s + 10)
        finally:
            self._close_loop()
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
