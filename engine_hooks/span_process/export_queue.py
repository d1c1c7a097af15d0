"""Export on a thread of its own, behind a bounded queue of spans.

The OTLP exporters send each batch synchronously, up to ``OTEL_EXPORTER_OTLP_TIMEOUT`` (10 s) and
their retries. Called from the round that built the spans (the pipeline's thread, or the span
process's loop), an endpoint that accepts connections and never answers would hold every round:
the span process stopped reading its pipe, the engine's process retired it and started another,
and each kept its backlog (#47). :class:`ExportQueue` takes a round's batches at once; one thread
sends them in order; when ``OTEL_LLM_EXPORT_QUEUE_SIZE`` spans wait already, a batch is dropped
and counted. What it holds at a deadline (:meth:`ExportQueue.close`) is dropped and counted too.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_llm.otlp.export import SafeSpanExporter

log = logging.getLogger("engine_hooks")

DEFAULT_MAX_SPANS = 8192


class ExportQueue(SafeSpanExporter):
    """A :class:`SafeSpanExporter` whose sends run on a daemon thread of its own, fed from a queue
    of at most ``max_spans`` spans, the batch being sent included. ``exported`` counts what the
    exporter took; ``dropped`` what it failed to send, what found the queue full
    (:attr:`dropped_full`) and what was queued or being sent at the deadline
    (:attr:`dropped_at_close`)."""

    def __init__(self, inner: SpanExporter, max_spans: int = DEFAULT_MAX_SPANS, name: str = "engine_hooks"):
        super().__init__(inner, name)
        self.max_spans = max_spans
        self._batches: collections.deque[Sequence] = collections.deque()
        self._queued = 0  # spans in _batches
        self._sending = 0  # spans the thread is sending now (0 again once counted)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.dropped_full = 0
        self.dropped_at_close = 0
        self._full_warned = False

    def export(self, spans: Sequence) -> SpanExportResult:
        """Queue ``spans`` (never waits); FAILURE, counted dropped, when the queue is full or closed."""
        n = len(spans)
        with self._cond:
            if not self._closed and self._queued + self._sending + n <= self.max_spans:
                self._batches.append(spans)
                self._queued += n
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="otel-llm-export", daemon=True)
                    self._thread.start()
                self._cond.notify()
                return SpanExportResult.SUCCESS
            self.dropped += n
            self.dropped_full += n
            warn, self._full_warned = not self._full_warned, True
            waiting = self._queued + self._sending
        if warn:
            log.warning(
                "%s: the span exporter is behind (%d spans wait for it, OTEL_LLM_EXPORT_QUEUE_SIZE=%d); "
                "dropping and counting spans until it catches up",
                self.name,
                waiting,
                self.max_spans,
            )
        return SpanExportResult.FAILURE

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._batches and not self._closed:
                    cond.wait()
                if not self._batches:
                    return
                batch = self._batches.popleft()
                self._queued -= len(batch)
                self._sending = len(batch)
            ok = self._send(batch)  # never raises
            with cond:
                if self._sending:  # else close() counted it already
                    if ok:
                        self.exported += self._sending
                    else:
                        self.dropped += self._sending
                    self._sending = 0
                cond.notify_all()

    @property
    def pending(self) -> int:
        """Spans queued or being sent now."""
        return self._queued + self._sending

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Wait until everything queued was sent (True), or ``timeout_millis``."""
        deadline = time.monotonic() + timeout_millis / 1000
        with self._cond:
            while self._queued or self._sending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return super().force_flush(max(0, int((deadline - time.monotonic()) * 1000)))

    def close(self, deadline: float) -> int:
        """Send what is queued until ``deadline`` (``time.monotonic()``), then stop: what is still
        queued or being sent is counted dropped (returned); a send that ends later is not counted
        again. The exporter is shut down when no send is stuck in it (one that is, on a hung
        endpoint, ends with the process)."""
        self.force_flush(max(0, int((deadline - time.monotonic()) * 1000)))
        with self._cond:
            self._closed = True
            left = self._queued + self._sending
            stuck = self._sending
            self.dropped += left
            self.dropped_at_close += left
            self._batches.clear()
            self._queued = self._sending = 0
            self._cond.notify_all()
        if not stuck:
            super().shutdown()
        return left

    def shutdown(self) -> None:
        self.close(time.monotonic())
