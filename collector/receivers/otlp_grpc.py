"""OTLP/gRPC trace receiver (``opentelemetry.proto.collector.trace.v1.TraceService/Export``).

The request arrives as raw bytes (no deserializer in grpc) so that a malformed payload is
answered INVALID_ARGUMENT with a message, not an internal error. Overload answers UNAVAILABLE
with a ``google.rpc.RetryInfo`` detail (what the OTLP exporters read to back off). Optional
bearer-token authentication and TLS.
"""

from __future__ import annotations

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
        self, intake: Intake, settings: ReceiverSettings, counters: ReceiverCounters, host: str, port: int, workers=4
    ):
        self.intake, self.settings, self.counters = intake, settings, counters
        cfg = settings
        opts = [("grpc.max_receive_message_length", cfg.max_message_bytes)]
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=opts)
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Export": grpc.unary_unary_rpc_method_handler(
                    self._export, request_deserializer=None, response_serializer=lambda m: m.SerializeToString()
                )
            },
        )
        metrics = grpc.method_handlers_generic_handler(
            METRICS_SERVICE,
            {
                "Export": grpc.unary_unary_rpc_method_handler(
                    self._export_metrics, request_deserializer=None, response_serializer=None
                )
            },
        )
        self.server.add_generic_rpc_handlers((handler, metrics))
        addr = f"{host}:{port}"
        creds = None
        if cfg.tls_cert and cfg.tls_key:
            with open(cfg.tls_key, "rb") as k, open(cfg.tls_cert, "rb") as c:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        try:
            if creds is not None:
                self.port = self.server.add_secure_port(addr, creds)
            else:
                self.port = self.server.add_insecure_port(addr)
        except RuntimeError:  # grpc raises this when the port cannot be bound (older releases returned 0)
            self.port = 0
        if not self.port:
            raise OSError(f"OTLP/gRPC receiver cannot listen on {addr} (in use, or not an address of this host)")
        self.address = (host, self.port)

    def _export_metrics(self, body: bytes, context) -> bytes:
        token = self.settings.auth_token
        if token and not token_matches(dict(context.invocation_metadata()).get("authorization"), token):
            self.counters.unauthenticated += 1
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        try:
            return self.intake.accept_metrics(body)
        except PayloadTooLarge as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _export(self, body: bytes, context):
        token = self.settings.auth_token
        if token:
            md = dict(context.invocation_metadata())
            if not token_matches(md.get("authorization"), token):
                self.counters.unauthenticated += 1
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        try:
            res = self.intake.accept(body)
        except PayloadTooLarge as exc:
            self.counters.payloads_invalid += 1
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except DecodeError as exc:
            self.counters.payloads_invalid += 1
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            context.set_trailing_metadata(retry_trailer(str(exc), Overloaded.retry_after_s))
            context.abort(grpc.StatusCode.UNAVAILABLE, f"collector overloaded: {exc}; retry later")
        resp = ExportTraceServiceResponse()
        if res.rejected:
            resp.partial_success.rejected_spans = res.rejected
            resp.partial_success.error_message = res.message or "spans rejected"
        return resp

    def start(self) -> GrpcReceiver:
        self.server.start()
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        self.server.stop(grace_s).wait()
