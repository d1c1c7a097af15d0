"""Trace assembly, after the OpenTelemetry Collector's groupbytrace processor.

Spans (walked span tuples, :mod:`collector.walked_span`) are grouped by trace id in a
:class:`TraceStorage` (in memory by default). A trace is released to derivation when
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

Deadlines need no priority queue: each kind is the clock plus a constant (timeout, grace, peer
wait), so each kind's deadlines come due in the order they were set. Three FIFO queues hold
them (the arrival ring doubles as the timeout queue); a deadline superseded by a later request
span is skipped when it comes up.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol

from . import walked_span as sp
from .config import AssemblyConfig


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

    def add(self, trace_id: bytes, span: tuple) -> bool: ...  # False: duplicate span
    def pop(self, trace_id: bytes) -> list[tuple] | None: ...
    def __contains__(self, trace_id: bytes) -> bool: ...
    def __len__(self) -> int: ...


class InMemoryTraceStorage:
    def __init__(self) -> None:
        self._spans: dict[bytes, dict[bytes, tuple]] = {}

    def add(self, trace_id: bytes, span: tuple) -> bool:
        t = self._spans.get(trace_id)
        sid = span[sp.SPAN_ID]
        if t is None:
            self._spans[trace_id] = {sid: span}
            return True
        if sid in t:
            return False
        t[sid] = span
        return True

    def pop(self, trace_id: bytes) -> list[tuple] | None:
        t = self._spans.pop(trace_id, None)
        return None if t is None else list(t.values())

    def __contains__(self, trace_id: bytes) -> bool:
        return trace_id in self._spans

    def __len__(self) -> int:
        return len(self._spans)


@dataclass(slots=True)
class _Entry:
    first_seen: float
    ready_at: float | None = None  # set when a request span arrives
    has_client: bool = False


@dataclass
class ReleasedTrace:
    trace_id: bytes
    spans: list[tuple]
    reason: str  # grace | timeout | evicted | flush


class TraceAssembler:
    def __init__(self, config: AssemblyConfig | None = None, storage: TraceStorage | None = None):
        self.config = config or AssemblyConfig()
        self.storage = storage if storage is not None else InMemoryTraceStorage()
        self.counters = AssemblyCounters()
        self._entries: dict[bytes, _Entry] = {}
        self._ring: deque[bytes] = deque()  # arrival order of traces: eviction and timeouts
        self._grace: deque[tuple[float, bytes]] = deque()  # (ready at, trace id), FIFO = deadline order
        self._peer: deque[tuple[float, bytes]] = deque()  # the same for traces waiting for their client span
        self._released: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, spans: list[tuple], now: float) -> list[ReleasedTrace]:
        """Add walked spans; returns traces evicted to make room (to derive now)."""
        cfg = self.config
        evicted: list[ReleasedTrace] = []
        entries, released, store = self._entries, self._released, self.storage
        grace, peer_wait = cfg.grace_s, max(cfg.grace_s, cfg.peer_wait_s)
        with self._lock:
            c = self.counters
            c.spans_received += len(spans)
            for s in spans:
                tid = s[sp.TRACE_ID]
                e = entries.get(tid)
                if e is None:
                    if tid in released:
                        c.spans_late += 1
                        continue
                    while len(entries) >= cfg.max_traces:
                        ev = self._release_oldest("evicted")
                        if ev is None:
                            break
                        evicted.append(ev)
                    e = entries[tid] = _Entry(now)
                    self._ring.append(tid)
                if not store.add(tid, s):
                    c.spans_duplicate += 1
                    continue
                code = s[sp.CODE]
                if code <= sp.ENGINE:  # a request span: its trace is ready after the grace period
                    if code == sp.CLIENT:
                        e.has_client = True
                    if not e.has_client and s[sp.PARENT_ID]:  # the caller's span is on its way
                        e.ready_at = now + peer_wait
                        self._peer.append((e.ready_at, tid))
                    else:
                        e.ready_at = now + grace
                        self._grace.append((e.ready_at, tid))
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
        entries = self._entries
        with self._lock:
            for q in (self._grace, self._peer):
                while q and q[0][0] <= now:
                    at, tid = q.popleft()
                    e = entries.get(tid)
                    if e is not None and e.ready_at == at:  # not superseded, not released
                        out.append(self._release(tid, "grace"))
            ring, timeout = self._ring, self.config.timeout_s
            while ring:
                e = entries.get(ring[0])
                if e is not None and e.first_seen + timeout > now:
                    break
                tid = ring.popleft()
                if e is not None:
                    out.append(self._release(tid, "timeout"))
            if len(ring) > 2 * max(len(entries), 1024):  # ids released by grace behind a waiting head
                self._ring = deque(t for t in ring if t in entries)
        return out

    def flush(self) -> list[ReleasedTrace]:
        """Release everything (shutdown)."""
        with self._lock:
            return [r for r in (self._release(t, "flush") for t in list(self._entries)) if r is not None]
