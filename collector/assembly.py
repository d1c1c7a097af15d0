"""Trace assembly, after the OpenTelemetry Collector's groupbytrace processor.

Spans are grouped by trace id in a :class:`TraceStorage` (in memory by default). A trace is
released to derivation when
* ``grace_s`` has passed since its last request span (``llm.request`` / ``llm.client.request``)
  arrived: request spans are exported when they end, so their phases and the other boundary have
  had time to arrive. An engine request span with a parent (the caller sent a ``traceparent``)
  and no client span yet waits ``peer_wait_s`` instead: the client's span ends later and its
  exporter batches (5 s by default in the OpenTelemetry SDK); or
* ``timeout_s`` has passed since its first span arrived (a trace with no request span, or one
  boundary missing); or
* the ring buffer of ``max_traces`` traces in flight is full: the oldest is released early
  (counted as evicted).
A span seen twice in a trace is ignored (counted); a span for a trace released recently is late:
counted and dropped, never derived twice. Everything is guarded by one lock; the caller's clock
(seconds, monotonic) drives deadlines.
"""
from __future__ import annotations

import heapq
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from otel_llm.otlp_spans import SpanRecord

from otel_llm.semconv import SPAN_CLIENT_REQUEST

from .receivers.decode import ROOT_SPANS


@dataclass
class AssemblyConfig:
    grace_s: float = 1.0  # wait after the last request span of a trace
    peer_wait_s: float = 10.0  # an engine span whose caller sent a traceparent waits this long for the client's span
    timeout_s: float = 30.0  # longest wait after a trace's first span
    max_traces: int = 100_000  # traces in flight (ring buffer)
    remember_released: int = 100_000  # released trace ids remembered, to count late spans


@dataclass
class AssemblyCounters:
    spans_received: int = 0
    spans_duplicate: int = 0
    spans_late: int = 0
    traces_released: int = 0
    traces_released_grace: int = 0
    traces_released_timeout: int = 0
    traces_evicted: int = 0


class TraceStorage(Protocol):
    """Where spans wait for their trace to be complete."""

    def add(self, trace_id: str, span: SpanRecord) -> bool: ...  # False: duplicate span
    def pop(self, trace_id: str) -> list[SpanRecord] | None: ...
    def __contains__(self, trace_id: str) -> bool: ...
    def __len__(self) -> int: ...


class InMemoryTraceStorage:
    def __init__(self) -> None:
        self._spans: dict[str, dict[str, SpanRecord]] = {}

    def add(self, trace_id: str, span: SpanRecord) -> bool:
        t = self._spans.get(trace_id)
        if t is None:
            self._spans[trace_id] = {span.span_id: span}
            return True
        if span.span_id in t:
            return False
        t[span.span_id] = span
        return True

    def pop(self, trace_id: str) -> list[SpanRecord] | None:
        t = self._spans.pop(trace_id, None)
        return None if t is None else list(t.values())

    def __contains__(self, trace_id: str) -> bool:
        return trace_id in self._spans

    def __len__(self) -> int:
        return len(self._spans)


@dataclass
class _Entry:
    first_seen: float
    ready_at: float | None = None  # set when a request span arrives
    has_client: bool = False


@dataclass
class ReleasedTrace:
    trace_id: str
    spans: list[SpanRecord]
    reason: str  # grace | timeout | evicted | flush


class TraceAssembler:
    def __init__(self, config: AssemblyConfig | None = None, storage: TraceStorage | None = None):
        self.config = config or AssemblyConfig()
        self.storage = storage if storage is not None else InMemoryTraceStorage()
        self.counters = AssemblyCounters()
        self._entries: dict[str, _Entry] = {}
        self._ring: deque[str] = deque()  # arrival order of traces, for eviction
        self._heap: list[tuple[float, str]] = []  # (deadline, trace id), lazily invalidated
        self._released: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, spans: list[SpanRecord], now: float) -> list[ReleasedTrace]:
        """Add spans; returns traces evicted to make room (to derive now)."""
        cfg = self.config
        evicted: list[ReleasedTrace] = []
        with self._lock:
            c = self.counters
            c.spans_received += len(spans)
            for s in spans:
                tid = s.trace_id
                if tid in self._released:
                    c.spans_late += 1
                    continue
                e = self._entries.get(tid)
                if e is None:
                    while len(self._entries) >= cfg.max_traces:
                        ev = self._release_oldest("evicted")
                        if ev is None:
                            break
                        evicted.append(ev)
                    e = self._entries[tid] = _Entry(now)
                    self._ring.append(tid)
                    heapq.heappush(self._heap, (now + cfg.timeout_s, tid))
                if not self.storage.add(tid, s):
                    c.spans_duplicate += 1
                    continue
                if s.name in ROOT_SPANS:
                    if s.name == SPAN_CLIENT_REQUEST:
                        e.has_client = True
                    waits_for_client = not e.has_client and s.parent_span_id
                    e.ready_at = now + (max(cfg.grace_s, cfg.peer_wait_s) if waits_for_client else cfg.grace_s)
                    heapq.heappush(self._heap, (e.ready_at, tid))
        return evicted

    def _release(self, tid: str, reason: str) -> ReleasedTrace | None:
        e = self._entries.pop(tid, None)
        if e is None:
            return None
        spans = self.storage.pop(tid) or []
        self._released[tid] = None
        while len(self._released) > self.config.remember_released:
            self._released.popitem(last=False)
        c = self.counters
        c.traces_released += 1
        if reason == "evicted":
            c.traces_evicted += 1
        elif reason == "grace":
            c.traces_released_grace += 1
        elif reason == "timeout":
            c.traces_released_timeout += 1
        return ReleasedTrace(tid, spans, reason)

    def _release_oldest(self, reason: str) -> ReleasedTrace | None:
        while self._ring:
            tid = self._ring.popleft()
            if tid in self._entries:
                return self._release(tid, reason)
        return None

    def expire(self, now: float) -> list[ReleasedTrace]:
        """Release every trace whose grace period or timeout has passed."""
        out: list[ReleasedTrace] = []
        with self._lock:
            heap = self._heap
            while heap and heap[0][0] <= now:
                _, tid = heapq.heappop(heap)
                e = self._entries.get(tid)
                if e is None:
                    continue
                if e.ready_at is not None and e.ready_at <= now:
                    out.append(self._release(tid, "grace"))
                elif e.first_seen + self.config.timeout_s <= now:
                    out.append(self._release(tid, "timeout"))
            if len(self._ring) > 2 * max(len(self._entries), 1024):  # drop ids already released
                self._ring = deque(t for t in self._ring if t in self._entries)
        return out

    def flush(self) -> list[ReleasedTrace]:
        """Release everything (shutdown)."""
        with self._lock:
            return [r for r in (self._release(t, "flush") for t in list(self._entries)) if r is not None]
