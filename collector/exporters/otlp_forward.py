"""Sending OTLP export requests on, off the receiving threads: ``--forward-traces URL`` (every
accepted trace export request, unchanged, to Jaeger or another collector) and ``--forward-records
URL`` (each derived record as an OTLP log record, :mod:`collector.exporters.records_logs`). Queued
and bounded in bytes (``max_queue_bytes``) as well as in requests: a full queue drops and counts (a
target that never answers cannot take the collector's memory); a failed send is counted. A stop
takes at most its timeout, whatever the target does: what is still queued then is dropped and
counted.

``URL``: ``http://host:4318`` (OTLP/HTTP protobuf, ``/v1/traces`` or ``/v1/logs`` appended) or
``grpc://host:4317``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import urllib.request
from collections.abc import Callable

log = logging.getLogger("collector")


def _signal(signal: str):
    """(request class, gRPC stub class) of an OTLP signal."""
    if signal == "traces":
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as rpc

        return pb.ExportTraceServiceRequest, rpc.TraceServiceStub
    if signal == "logs":
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as pb
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc as rpc

        return pb.ExportLogsServiceRequest, rpc.LogsServiceStub
    raise ValueError(f"unknown OTLP signal {signal!r}")


class OTLPForwarder:
    """Sends serialized export requests of one OTLP ``signal`` (traces, logs) to ``url``."""

    def __init__(
        self,
        url: str,
        max_queue: int = 10_000,
        timeout_s: float = 10.0,
        max_queue_bytes: int = 64 << 20,
        signal: str = "traces",
        transform: Callable[[bytes], bytes] | None = None,
    ):
        """``transform``: applied to each body on the sending thread, just before it is sent (the
        copy forwarded, e.g. :func:`collector.exporters.array_summary.summarise`)."""
        self.url, self.timeout_s, self.max_queue_bytes, self.signal = url, timeout_s, max_queue_bytes, signal
        self._transform = transform
        self._request_cls, stub_cls = _signal(signal)
        self._q: queue.Queue = queue.Queue(max_queue)
        self.sent = self.failed = self.dropped = 0
        self.queued_bytes = 0  # bodies waiting to be sent
        self._give_up_at = float("inf")  # monotonic: set by stop; past it the queue is dropped
        self._bytes_lock = threading.Lock()
        self._warned = False
        if url.startswith("grpc://"):
            import grpc

            self._channel = grpc.insecure_channel(url[len("grpc://") :])
            self._stub = stub_cls(self._channel)
            self._send = self._grpc_send
        elif url.startswith(("http://", "https://")):
            path = f"/v1/{signal}"
            self._endpoint = url.rstrip("/") + ("" if url.rstrip("/").endswith(path) else path)
            self._send = self._http_send
        else:
            raise ValueError(f"--forward-{signal} {url!r}: expected http://HOST:PORT or grpc://HOST:PORT")
        self._thread = threading.Thread(target=self._run, name=f"forward-{signal}", daemon=True)

    def _grpc_send(self, body: bytes) -> None:
        req = self._request_cls()
        req.ParseFromString(body)
        self._stub.Export(req, timeout=self.timeout_s)

    def _http_send(self, body: bytes) -> None:
        r = urllib.request.Request(
            self._endpoint, data=body, method="POST", headers={"Content-Type": "application/x-protobuf"}
        )
        with urllib.request.urlopen(r, timeout=self.timeout_s) as resp:
            resp.read()

    def submit(self, body: bytes) -> None:
        """Queue one serialized export request of the forwarder's signal (protobuf)."""
        with self._bytes_lock:
            if self.queued_bytes + len(body) > self.max_queue_bytes:
                self.dropped += 1
                return
            self.queued_bytes += len(body)
        try:
            self._q.put_nowait(body)
        except queue.Full:
            with self._bytes_lock:
                self.queued_bytes -= len(body)
            self.dropped += 1

    def _run(self) -> None:
        while True:
            body = self._q.get()
            if body is None:
                return
            with self._bytes_lock:
                self.queued_bytes -= len(body)
            if time.monotonic() > self._give_up_at:  # stopping, out of time: dropped, counted
                self.dropped += 1
                continue
            try:
                self._send(body if self._transform is None else self._transform(body))
                self.sent += 1
            except Exception as exc:
                self.failed += 1
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "collector: forwarding %s to %s failed (%s); counting and going on", self.signal, self.url, exc
                    )

    def start(self) -> OTLPForwarder:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is queued for at most ``timeout_s`` seconds; the rest is dropped and counted."""
        self._give_up_at = time.monotonic() + timeout_s
        if not stop_worker(self._q, self._thread, timeout_s):  # still sending (a target that never answers)
            while True:  # what is left is taken out and counted here, so the worker cannot count it again
                try:
                    body = self._q.get_nowait()
                except queue.Empty:
                    break
                if body is not None:
                    self.dropped += 1
                    with self._bytes_lock:
                        self.queued_bytes -= len(body)


def stop_worker(q: queue.Queue, thread: threading.Thread, timeout_s: float) -> bool:
    """End a queue's worker thread: a ``None`` after what is queued (or, the queue being full, as
    soon as there is room), then wait for it; ``timeout_s`` in all. False: still running then."""
    deadline = time.monotonic() + timeout_s
    try:
        q.put(None, timeout=timeout_s)
    except queue.Full:
        return False
    thread.join(max(0.0, deadline - time.monotonic()))
    return not thread.is_alive()
