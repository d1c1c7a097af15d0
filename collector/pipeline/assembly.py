"""Trace assembly, after the OpenTelemetry Collector's groupbytrace processor.

Spans (walked span tuples, :mod:`collector.pipeline.walked_span`) are grouped by trace id in a
:class:`TraceStorage` (in memory by default). A trace is released to derivation when
* ``grace_s`` has passed since its last request span (``llm.request`` / ``llm.client.request``)
  arrived: request spans are exported when they end, so their phases and the other boundary have
  had time to arrive. An engine request span with a parent (the caller sent a ``traceparent``)
  and no client span yet waits ``peer_wait_s`` instead: the client's span ends later and its
  exporter batches (5 s by default in the OpenTelemetry SDK); or
* ``timeout_s`` has passed since its first span arrived (a trace with no request span, or one
  boundary missing); or
* the ring buffer of ``max_traces`` traces in flight is full: the oldest is released early
  (counted as evicted). With ``on_full="refuse"`` (the tail-sampling processor's
  ``block_on_overflow``), a request that would need room is refused instead (:class:`AssemblyFull`,
  -> UNAVAILABLE / 503: the sender retries), and nothing is evicted.
A span seen twice in a trace is ignored (counted). A span for a trace released recently is late:
if its boundary (client: ``llm.client.request``; engine: every other span) was already derived it
is counted and dropped, never derived twice; if not (the other process's spans came after the
trace was released, as they do under eviction), the trace is opened again for that boundary
alone and derived as an unpaired record (``spans_late_derived``). Everything is guarded by one lock; the caller's clock
(seconds, monotonic) drives deadlines.

Deadlines need no priority queue: each kind is the clock plus a constant (timeout, grace, peer
wait), so each kind's deadlines come due in the order they were set. Three FIFO queues hold
them (the arrival ring doubles as the timeout queue); a deadline superseded by a later request
span is skipped when it comes up.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from ..config import AssemblyConfig
from . import walked_span as sp
from .genai_client_spans import is_genai_client_span


@dataclass
class AssemblyCounters:
    spans_received: int = 0
    spans_duplicate: int = 0
    spans_late: int = 0  # dropped: their boundary was derived already
    spans_late_derived: int = 0  # late, for a boundary not derived yet: derived on their own
    spans_over_trace_limit: int = 0  # dropped: their trace already had max_spans_per_trace
    requests_refused_full: int = 0  # on_full="refuse": export requests refused for want of room
    traces_released: int = 0
    traces_released_grace: int = 0
    traces_released_timeout: int = 0
    traces_evicted: int = 0


class AssemblyFull(Exception):
    """``on_full="refuse"`` and a request's new traces do not fit in ``max_traces``."""


_CLIENT_BIT, _ENGINE_BIT = 1, 2


def _request_bit(s: tuple) -> int:
    """The boundary a span makes a record of (0: none, a phase or another span): otel-llm's request
    spans, and a GenAI client instrumentation's span, derived as a client request span."""
    code = s[sp.CODE]
    if code == sp.CLIENT or (code == sp.GENAI_CLIENT and is_genai_client_span(s)):
        return _CLIENT_BIT
    return _ENGINE_BIT if code == sp.ENGINE else 0


def _boundary_bit(s: tuple) -> int:
    """The boundary a span belongs to: its record's, else the engine's (a phase span)."""
    return _request_bit(s) or _ENGINE_BIT


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
    late: bool = False  # opened again after a release, for a boundary not derived then
    spans: int = 0
    bytes: int = 0  # memory its spans hold, as the caller estimated it (see add)


@dataclass
class ReleasedTrace:
    trace_id: bytes
    spans: list[tuple]
    reason: str  # grace | timeout | evicted | flush
    bytes: int = 0  # memory its spans hold, as estimated when they were added


class RecentTraces:
    """Trace id -> boundary bits derived, for the ``limit`` traces released last, at least the
    last ``limit // 2``: two generations of dicts, the older dropped whole when the newer is half
    full (O(1) per release, at most ``limit`` ids held, about 110 bytes each)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._new: dict[bytes, int] = {}
        self._old: dict[bytes, int] = {}

    def get(self, tid: bytes) -> int | None:
        bits = self._new.get(tid)
        return self._old.get(tid) if bits is None else bits

    def add(self, tid: bytes, bits: int) -> None:
        if not self.limit:
            return
        self._new[tid] = (self.get(tid) or 0) | bits
        if len(self._new) >= max(1, self.limit // 2):
            self._old, self._new = self._new, {}

    def __len__(self) -> int:
        return len(self._new) + len(self._old)


class TraceAssembler:
    def __init__(self, config: AssemblyConfig | None = None, storage: TraceStorage | None = None):
        self.config = config or AssemblyConfig()
        self.storage = storage if storage is not None else InMemoryTraceStorage()
        self.counters = AssemblyCounters()
        self._entries: dict[bytes, _Entry] = {}
        self._ring: deque[bytes] = deque()  # arrival order of traces: eviction and timeouts
        self._grace: deque[tuple[float, bytes]] = deque()  # (ready at, trace id), FIFO = deadline order
        self._peer: deque[tuple[float, bytes]] = deque()  # the same for traces waiting for their client span
        self._released = RecentTraces(self.config.remember_released)  # trace id -> boundary bits derived
        self._lock = threading.Lock()
        self.bytes = 0  # memory held by the spans in flight, as estimated by the callers of add

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, spans: list[tuple], now: float, bytes_per_span: int = 0) -> list[ReleasedTrace]:
        """Add walked spans, each holding about ``bytes_per_span`` bytes (counted in :attr:`bytes`
        while its trace is in flight); returns traces evicted to make room (to derive now). Raises
        :class:`AssemblyFull` (adding nothing) when ``on_full="refuse"`` and they do not fit."""
        cfg = self.config
        evicted: list[ReleasedTrace] = []
        entries, released, store = self._entries, self._released, self.storage
        grace, peer_wait = cfg.grace_s, max(cfg.grace_s, cfg.peer_wait_s)
        span_cap = cfg.max_spans_per_trace
        with self._lock:
            c = self.counters
            if cfg.on_full == "refuse":
                new = {s[sp.TRACE_ID] for s in spans} - entries.keys()
                if len(entries) + len(new) > cfg.max_traces:
                    c.requests_refused_full += 1
                    raise AssemblyFull(f"{len(entries)} of {cfg.max_traces} traces in flight")
            c.spans_received += len(spans)
            for s in spans:
                tid = s[sp.TRACE_ID]
                e = entries.get(tid)
                if e is None or e.late:
                    done = released.get(tid)
                    if done is not None and done & _boundary_bit(s):
                        c.spans_late += 1
                        continue
                if e is None:
                    while len(entries) >= cfg.max_traces:
                        ev = self._release_oldest("evicted")
                        if ev is None:
                            break
                        evicted.append(ev)
                    e = entries[tid] = _Entry(now, late=done is not None)
                    self._ring.append(tid)
                if e.spans >= span_cap:
                    c.spans_over_trace_limit += 1
                    continue
                if e.late:
                    c.spans_late_derived += 1
                if not store.add(tid, s):
                    c.spans_duplicate += 1
                    continue
                e.spans += 1
                e.bytes += bytes_per_span
                self.bytes += bytes_per_span
                code = s[sp.CODE]
                bit = (code <= sp.ENGINE or code == sp.GENAI_CLIENT) and _request_bit(s)
                if bit:  # a request span: its trace is ready after the grace period
                    if bit == _CLIENT_BIT:
                        e.has_client = True
                    if not e.has_client and s[sp.PARENT_ID] and not e.late:  # the caller's span is on its way
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
        bits = 0
        for s in spans:
            code = s[sp.CODE]
            if code <= sp.ENGINE or code == sp.GENAI_CLIENT:  # a boundary is derived where its request span is
                bits |= _request_bit(s)
        self._released.add(tid, bits)
        c = self.counters
        c.traces_released += 1
        if reason == "evicted":
            c.traces_evicted += 1
        elif reason == "grace":
            c.traces_released_grace += 1
        elif reason == "timeout":
            c.traces_released_timeout += 1
        self.bytes -= e.bytes
        return ReleasedTrace(tid, spans, reason, e.bytes)

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

    def oldest_first_seen(self) -> float | None:
        """When the oldest trace still in flight got its first span (None: none in flight)."""
        with self._lock:
            for tid in self._ring:
                e = self._entries.get(tid)
                if e is not None:
                    return e.first_seen
        return None

    def flush(self) -> list[ReleasedTrace]:
        """Release everything (shutdown)."""
        with self._lock:
            return [r for r in (self._release(t, "flush") for t in list(self._entries)) if r is not None]
