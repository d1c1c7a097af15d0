"""Trace assembly, after the OpenTelemetry Collector's groupbytrace processor.

Spans (walked span tuples, :mod:`collector.pipeline.walked_span`) are grouped by trace id in a
:class:`TraceStorage` (in memory by default). The unit derived is the request, not the trace: a
trace may hold many requests (an agent's or a chain's calls under one application span, minutes
apart), so what is released is the trace's spans held so far, and the trace's later spans open it
again as a new request group. A trace's group is released when
* ``grace_s`` has passed since its last request span (``llm.request`` / ``llm.client.request``, a
  GenAI client's span) arrived and every engine request span that has a caller (a ``traceparent``)
  has a client span beside it: request spans are exported when they end, so their phases and the
  other boundary have had time to arrive. While the group holds more such engine spans than
  client spans it waits ``peer_wait_s`` after the last of them instead: the client's span ends
  later and its exporter batches (5 s by default in the OpenTelemetry SDK); so too while it holds
  more client spans that say ``cancelled`` than such engine spans: an engine keeps an aborted
  request's span for its abort grace (``OTEL_LLM_ABORT_GRACE``, 1 s) to count the tokens it made
  after the abort, so a client that exports at once (a ``SimpleSpanProcessor``) is ahead of it; or
* ``timeout_s`` has passed since its first span arrived (a group with no request span, one
  boundary missing, or calls back to back): the engine spans still waiting for their client
  within ``peer_wait_s`` of their arrival, with their phases and server span, are kept back as
  the trace's next group, so that a call in flight at the timeout is not split; or
* the ring buffer of ``max_traces`` groups in flight is full: the oldest is released early
  (counted as evicted). With ``on_full="refuse"`` (the tail-sampling processor's
  ``block_on_overflow``), a request that would need room is refused instead (:class:`AssemblyFull`,
  -> UNAVAILABLE / 503: the sender retries), and nothing is evicted.
A span seen twice in a group is ignored (counted). What was released is remembered per request
(:class:`RecentRequests`): a request span released already (the same span id, or the same request
id at the same boundary), a phase of an engine request released already, or the server span above
one is late: counted and dropped, never derived twice. A request span whose other boundary was
released without it (the other process's spans came after, as they do under eviction) opens a
group derived as an unpaired record (``spans_late_derived``). Everything is guarded by one lock;
the caller's clock (seconds, monotonic) drives deadlines.

A GenAI client instrumentation's span whose trace context did not reach the server (the openai SDK's
instrumentation puts no ``traceparent`` on the request) is in a trace of its own, yet its
``gen_ai.response.id`` is the server's id for the request. Such a span joins the group of the
engine request span with that id, in whatever trace it is (``spans_paired_by_id``), when that
group is still in flight; one that comes first waits ``peer_wait_s`` in its own trace's group for
that engine span, which takes it into its group when it comes. Never by time: only the id joins,
and only a group still in flight (an engine span waits ``peer_wait_s`` for its caller anyway).

Deadlines need no priority queue: each kind is the clock plus a constant (timeout, grace, peer
wait), so each kind's deadlines come due in the order they were set. Three FIFO queues hold
them (the arrival ring doubles as the timeout queue); a deadline superseded by a later request
span is skipped when it comes up.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from otel_llm.semconv import PdRole, RequestStatus

from ..config import AssemblyConfig
from . import walked_span as sp
from .genai_client_spans import is_genai_client_span


@dataclass
class AssemblyCounters:
    spans_received: int = 0
    spans_duplicate: int = 0
    spans_late: int = 0  # dropped: their request (or its phase's) was derived already
    spans_late_derived: int = 0  # late, for a boundary not derived yet: derived on their own
    spans_held_back: int = 0  # kept past a timeout release: an engine span still waiting for its client
    spans_paired_by_id: int = 0  # GenAI client spans that joined their engine's trace by response id
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


def _request_id(s: tuple, bit: int) -> str | None:
    """A request span's request id (None: it says none): ours, a GenAI client's response id (the
    server's id for the response), vLLM's or SGLang's own."""
    for slot in (
        (sp.REQUEST_ID, sp.RESPONSE_ID) if bit == _CLIENT_BIT else (sp.REQUEST_ID, sp.GENAI_REQUEST_ID, sp.SGLANG_RID)
    ):
        rid = s[slot]
        if type(rid) is str and rid:
            return rid
    return None


def _request_key(s: tuple, bit: int) -> bytes | None:
    """A request span's request id at its boundary (and choice), as 8 bytes (None: it says none):
    the same id at the same boundary is the same request, whatever its span id."""
    rid = _request_id(s, bit)
    if rid is None:
        return None
    c = s[sp.CHOICE]
    text = f"{bit}:{rid}#{c if type(c) is int else ''}"
    if s[sp.PD_ROLE] == PdRole.PREFILL:  # a P/D proxy gives both legs the same id (vLLM's: X-Request-Id)
        text = "P" + text
    return hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).digest()


class TraceStorage(Protocol):
    """Where spans wait for their trace to be complete."""

    def add(self, trace_id: bytes, span: tuple) -> bool: ...  # False: duplicate span
    def pop(self, trace_id: bytes) -> list[tuple] | None: ...
    def take(self, trace_id: bytes, span_id: bytes) -> tuple | None: ...  # one span out (None: not there)
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

    def take(self, trace_id: bytes, span_id: bytes) -> tuple | None:
        t = self._spans.get(trace_id)
        return None if t is None else t.pop(span_id, None)

    def __contains__(self, trace_id: bytes) -> bool:
        return trace_id in self._spans

    def __len__(self) -> int:
        return len(self._spans)


@dataclass(slots=True)
class _Entry:
    """A trace's group of spans in flight: its requests since the trace's last release."""

    first_seen: float
    released: bytearray | dict | None = None  # what earlier groups of the trace released (RecentRequests)
    ready_at: float | None = None  # set when a request span arrives
    clients: int = 0  # client request spans
    callers: int = 0  # engine request spans with a caller (a parent) that may still send its span
    # P/D legs waiting for their other leg (collector/pipeline/disagg.py): > 0 prefill legs (their
    # decode leg answers for them), < 0 decode legs (counted once more in callers until it comes)
    pd_legs: int = 0
    cancelled: int = 0  # client request spans that say cancelled: their engines send theirs late
    waiting: dict | None = None  # span id -> arrival of those engine spans (kept back at a timeout)
    late: bool = False  # opened by a boundary of a request released without it
    held: set | None = None  # engine span ids a timeout kept back once: the next releases them
    rids: list | None = None  # the request ids of its engine request spans (in TraceAssembler._engine_by_id)
    id_clients: list | None = None  # GenAI client spans waiting for their engine by id: (rid, span id)
    id_until: float = 0.0  # while they wait: the group is not ready before this
    moved_in: list | None = None  # GenAI client spans of other traces it took: their (trace id, span)
    spans: int = 0
    bytes: int = 0  # memory its spans hold, as the caller estimated it (see add)


@dataclass
class ReleasedTrace:
    trace_id: bytes
    spans: list[tuple]
    reason: str  # grace | timeout | evicted | flush
    bytes: int = 0  # memory its spans hold, as estimated when they were added


# what RecentRequests remembers of a released request: a tag byte and 8 bytes
_CLIENT_DONE = b"C"  # + span id: a client request span released (derived)
_ENGINE_DONE = b"E"  # + span id: an engine request span released; its phases are late after it
_ABOVE_DONE = b"A"  # + span id: the span above a released engine span (its server span, its caller)
_ID_DONE = b"R"  # + _request_key: a request id released at its boundary
_KEY = 9


_SMALL = 16 * _KEY  # a trace's keys are bytes back to back up to this; an ordered dict beyond


def _has(known: bytearray | dict, key: bytes) -> bool:
    """Whether ``known`` (a trace's remembered keys: 9-byte keys back to back, or a dict of them
    once the trace has many requests) holds ``key``."""
    if type(known) is dict:
        return key in known
    i = known.find(key)
    while i >= 0 and i % _KEY:
        i = known.find(key, i + 1)
    return i >= 0


class RecentRequests:
    """Trace id -> what was released of it, for the ``limit`` requests released last, at least the
    last ``limit // 2``: two generations of dicts, the older dropped whole once the newer has seen
    ``limit // 2`` requests (O(1) per request). A trace's keys (9 bytes each) are one ``bytearray``
    while it has released a few requests (about 180 bytes a request with the trace's entry), and an
    insertion-ordered dict once it has released more (each lookup O(1), not a scan: a trace of
    10,000 calls). One trace keeps at most ``per_trace`` keys (its oldest half is forgotten beyond
    that), so a trace that never ends cannot take the memory."""

    def __init__(self, limit: int, per_trace: int = 5 * 4096):
        self.limit = limit
        self.per_trace = per_trace
        self._new: dict[bytes, bytearray | dict] = {}
        self._old: dict[bytes, bytearray | dict] = {}
        self._requests = 0  # requests remembered in _new

    def get(self, tid: bytes) -> bytearray | dict | None:
        known = self._new.get(tid)
        return self._old.get(tid) if known is None else known

    def add(self, tid: bytes, keys: bytes, requests: int) -> None:
        if not self.limit or not keys:
            return
        known = self._new.get(tid)
        if known is None:
            known = self._old.pop(tid, None)
            if known is None:
                known = bytearray()
        if type(known) is bytearray and len(known) + len(keys) > _SMALL:
            known = dict.fromkeys(bytes(known[i : i + _KEY]) for i in range(0, len(known), _KEY))
        if type(known) is dict:
            known.update(dict.fromkeys(keys[i : i + _KEY] for i in range(0, len(keys), _KEY)))
            if len(known) > self.per_trace:
                kept = list(known)[len(known) // 2 :]
                known = dict.fromkeys(kept)
        else:
            known += keys
        self._new[tid] = known
        self._requests += requests
        if self._requests >= max(1, self.limit // 2):
            self._old, self._new, self._requests = self._new, {}, 0

    def __len__(self) -> int:
        return len(self._new) + len(self._old)


def _released_keys(spans: list[tuple]) -> tuple[bytes, int]:
    """What to remember of released spans (their 9-byte keys back to back) and how many requests
    they hold."""
    keys: list[bytes] = []
    clients = engines = 0
    by_id = None
    for s in spans:
        bit = _request_bit(s)
        if not bit:
            continue
        if bit == _CLIENT_BIT:
            clients += 1
            keys.append(_CLIENT_DONE + s[sp.SPAN_ID])
        else:
            engines += 1
            keys.append(_ENGINE_DONE + s[sp.SPAN_ID])
            parent = s[sp.PARENT_ID]
            if parent:  # the server span above it (late: dropped), or its caller (late: derived alone)
                keys.append(_ABOVE_DONE + parent)
                if by_id is None:
                    by_id = {x[sp.SPAN_ID]: x for x in spans}
                above = by_id.get(parent)
                # (not a P/D prefill leg's: the proxy's span above it is above its decode leg too)
                if (
                    above is not None
                    and above[sp.CODE] == sp.SERVER
                    and above[sp.PARENT_ID]
                    and s[sp.PD_ROLE] != PdRole.PREFILL
                ):
                    keys.append(_ABOVE_DONE + above[sp.PARENT_ID])
        rk = _request_key(s, bit)
        if rk is not None:
            keys.append(_ID_DONE + rk)
    return b"".join(keys), max(clients, engines)


def _late(blob: bytearray | dict, s: tuple) -> int:
    """What a span of a trace with released requests is: 0 new, 1 late (released already: drop),
    2 a boundary of a released request not released yet (derived on its own)."""
    bit = _request_bit(s)
    sid, parent = s[sp.SPAN_ID], s[sp.PARENT_ID]
    if bit:  # a request span: released already (its span, or its request id at its boundary)?
        rk = _request_key(s, bit)
        if _has(blob, (_CLIENT_DONE if bit == _CLIENT_BIT else _ENGINE_DONE) + sid) or (
            rk is not None and _has(blob, _ID_DONE + rk)
        ):
            return 1
        # else its other boundary may have been: a client above a released engine, an engine
        # below a released client
        other = _ABOVE_DONE + sid if bit == _CLIENT_BIT else (_CLIENT_DONE + parent if parent else b"")
        return 2 if other and _has(blob, other) else 0
    if s[sp.CODE] == sp.SERVER:
        return 1 if _has(blob, _ABOVE_DONE + sid) else 0
    return 1 if parent and _has(blob, _ENGINE_DONE + parent) else 0


def _hold_back(spans: list[tuple], waiting: dict, since: float, once=()) -> tuple[list[tuple], list[tuple]]:
    """(released, held): the engine request spans in ``waiting`` that arrived after ``since`` and
    have no client span in the group (none above them, none with their request id), with their
    phases and the server span above them, are held, unless held ``once`` already; so are the GenAI
    client spans in ``waiting`` (waiting for their engine's by response id) whose engine span is not
    in the group; the rest is released."""
    by_id = {s[sp.SPAN_ID]: s for s in spans}
    client_ids, client_rids, engine_rids = set(), set(), set()
    for s in spans:
        bit = _request_bit(s)
        if bit == _CLIENT_BIT:
            client_ids.add(s[sp.SPAN_ID])
            client_rids.add(_request_id(s, _CLIENT_BIT))
        elif bit == _ENGINE_BIT:
            engine_rids.add(_request_id(s, _ENGINE_BIT))
    hold: set[bytes] = set()
    for sid, at in waiting.items():
        e = by_id.get(sid)
        if e is None or at <= since or sid in once:
            continue
        if e[sp.CODE] == sp.GENAI_CLIENT:  # a call span waiting for its engine's
            if e[sp.RESPONSE_ID] not in engine_rids:
                hold.add(sid)
            continue
        rid = _request_id(e, _ENGINE_BIT)
        if rid is not None and rid in client_rids:
            continue
        p, hops, found = e[sp.PARENT_ID], 0, False
        while p and hops < 64 and not found:
            found = p in client_ids
            above = by_id.get(p)
            p, hops = (above[sp.PARENT_ID] if above is not None else b""), hops + 1
        if found:
            continue
        hold.add(sid)
        above = by_id.get(e[sp.PARENT_ID])
        if above is not None and above[sp.CODE] == sp.SERVER:
            hold.add(above[sp.SPAN_ID])
    if not hold:
        return spans, []
    held = [s for s in spans if s[sp.SPAN_ID] in hold or (s[sp.PARENT_ID] in hold and s[sp.CODE] > sp.ENGINE)]
    ids = {s[sp.SPAN_ID] for s in held}
    return [s for s in spans if s[sp.SPAN_ID] not in ids], held


class TraceAssembler:
    def __init__(self, config: AssemblyConfig | None = None, storage: TraceStorage | None = None):
        self.config = config or AssemblyConfig()
        self.storage = storage if storage is not None else InMemoryTraceStorage()
        self.counters = AssemblyCounters()
        self._entries: dict[bytes, _Entry] = {}
        self._ring: deque[bytes] = deque()  # arrival order of traces: eviction and timeouts
        self._grace: deque[tuple[float, bytes]] = deque()  # (ready at, trace id), FIFO = deadline order
        self._peer: deque[tuple[float, bytes]] = deque()  # the same for traces waiting for their client span
        self._released = RecentRequests(self.config.remember_released)  # trace id -> what it released
        # request id -> the group (trace id) holding its engine span; a set where groups of several
        # traces in flight hold one (an id a client reused, X-Request-Id: ambiguous, never joined by)
        self._engine_by_id: dict[str, bytes | set] = {}
        # response id -> the GenAI client spans waiting for its engine span: (trace id, span id); joined
        # only while exactly one waits
        self._client_by_id: dict[str, list[tuple[bytes, bytes]]] = {}
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
        entries, released = self._entries, self._released
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
                history = released.get(tid) if e is None else e.released
                late = 0 if history is None else _late(history, s)
                if late == 1:
                    c.spans_late += 1
                    continue
                if late == 0 and s[sp.CODE] == sp.GENAI_CLIENT:
                    to = self._engine_group(s, tid)
                    if to is not None:  # its engine span is in a trace of its own, still in flight
                        self._take_in(to, s, now, bytes_per_span)
                        continue
                if e is None:
                    while len(entries) >= cfg.max_traces:
                        ev = self._release_oldest("evicted")
                        if ev is None:
                            break
                        evicted.append(ev)
                    e = entries[tid] = _Entry(now, history, late=late == 2)
                    self._ring.append(tid)
                if not self._keep(tid, e, s, bytes_per_span):
                    continue
                code = s[sp.CODE]
                bit = (code <= sp.ENGINE or code == sp.GENAI_CLIENT) and _request_bit(s)
                if bit:
                    self._request_arrived(tid, e, s, bit, late == 2, now)
                    if late or e.late:
                        continue
                    if bit == _ENGINE_BIT:
                        self._engine_in(tid, e, s, now)
                    elif code == sp.GENAI_CLIENT:
                        self._client_waits(tid, e, s, now)
        return evicted

    def _engine_group(self, s: tuple, tid: bytes) -> bytes | None:
        """The group in flight, of another trace, holding the engine request span whose id is this
        GenAI client span's response id (None: none)."""
        rid = s[sp.RESPONSE_ID]
        if type(rid) is not str or not rid or not is_genai_client_span(s):
            return None
        to = self._engine_by_id.get(rid)
        return to if type(to) is bytes and to != tid and to in self._entries else None

    def _keep(self, tid: bytes, e: _Entry, s: tuple, bytes_per_span: int) -> bool:
        """Store span ``s`` in group ``tid`` (``e``): False, counted, when the group is at
        ``max_spans_per_trace`` or already holds it."""
        c = self.counters
        if e.spans >= self.config.max_spans_per_trace:
            c.spans_over_trace_limit += 1
            return False
        if e.late:
            c.spans_late_derived += 1
        if not self.storage.add(tid, s):
            c.spans_duplicate += 1
            return False
        e.spans += 1
        e.bytes += bytes_per_span
        self.bytes += bytes_per_span
        return True

    def _take_in(self, to: bytes, s: tuple, now: float, bytes_per_span: int) -> None:
        """A GenAI client span of another trace joins group ``to``, which holds its engine span."""
        e = self._entries[to]
        if not self._keep(to, e, s, bytes_per_span):
            return
        if e.moved_in is None:
            e.moved_in = []
        e.moved_in.append(s)
        self.counters.spans_paired_by_id += 1
        self._request_arrived(to, e, s, _CLIENT_BIT, False, now)

    def _client_waits(self, tid: bytes, e: _Entry, s: tuple, now: float) -> None:
        """A GenAI client span whose engine span is not in flight (neither in its trace nor, by its
        response id, in another) keeps its group ``peer_wait_s`` for it."""
        rid = s[sp.RESPONSE_ID]
        if type(rid) is not str or not rid or (e.rids and rid in e.rids):
            return
        self._client_by_id.setdefault(rid, []).append((tid, s[sp.SPAN_ID]))
        if e.id_clients is None:
            e.id_clients = []
        e.id_clients.append((rid, s[sp.SPAN_ID]))
        if e.waiting is None:
            e.waiting = {}
        e.waiting[s[sp.SPAN_ID]] = now  # a timeout release holds it back, as an engine span waiting
        e.id_until = e.ready_at = now + self._peer_wait()
        self._peer.append((e.ready_at, tid))

    def _engine_in(self, tid: bytes, e: _Entry, s: tuple, now: float) -> None:
        """An engine request span is in group ``tid``: its id is known to GenAI client spans that
        come later, and the one waiting for it (in its own trace) joins it."""
        rid = _request_id(s, _ENGINE_BIT)
        if rid is None or s[sp.PD_ROLE] == PdRole.PREFILL:  # a prefill leg's id is its decode leg's too
            return
        had = self._engine_by_id.get(rid)
        if had is None or had == tid:
            self._engine_by_id[rid] = tid
        else:  # another trace's engine span in flight has this id too: nothing joins by it
            self._engine_by_id[rid] = (had if type(had) is set else {had}) | {tid}
        if e.rids is None:
            e.rids = []
        e.rids.append(rid)
        waiting = self._client_by_id.get(rid)
        if type(self._engine_by_id[rid]) is set or not waiting or len(waiting) != 1:
            return  # ambiguous: each is derived as it is
        del self._client_by_id[rid]
        ctid, sid = waiting[0]
        ce = self._entries.get(ctid)
        if ce is None:
            return
        if ce.id_clients and (rid, sid) in ce.id_clients:
            ce.id_clients.remove((rid, sid))
        if ce.waiting:
            ce.waiting.pop(sid, None)
        # its own trace (the trace context reached the server after all): paired by trace; else the
        # span moves to the engine's group
        span = None if ctid == tid else self.storage.take(ctid, sid)
        moved = 0
        if span is not None:
            moved = ce.bytes // max(ce.spans, 1)
            ce.spans, ce.clients, ce.bytes = ce.spans - 1, ce.clients - 1, ce.bytes - moved
            self.bytes -= moved
        if not ce.id_clients and ce.id_until:  # nothing waits by id there any more: its usual deadline
            ce.id_until = 0.0
            if ce.callers <= ce.clients:
                ce.ready_at = now + self.config.grace_s
                self._grace.append((ce.ready_at, ctid))
        if span is not None:
            self._take_in(tid, span, now, moved)

    def _peer_wait(self) -> float:
        """Seconds an engine span with a caller waits for the caller's span (never less than the grace)."""
        return max(self.config.grace_s, self.config.peer_wait_s)

    def _request_arrived(self, tid: bytes, e: _Entry, s: tuple, bit: int, late: bool, now: float) -> None:
        """A request span joined ``e``: the group is ready after the grace period, or after the peer
        wait while it holds more engine spans with a caller than client spans."""
        if bit == _CLIENT_BIT:
            e.clients += 1
            if s[sp.STATUS] == RequestStatus.CANCELLED and not late and not e.late:
                # its engine holds an aborted request for its abort grace (1 s) before it sends its
                # span: the group waits for it as an engine span waits for its caller's
                e.cancelled += 1
                if e.cancelled > e.callers:
                    e.ready_at = now + self._peer_wait()
                    self._peer.append((e.ready_at, tid))
                    return
        elif s[sp.PARENT_ID] and not late and not e.late:  # the caller's span may be on its way
            e.callers += 1
            role = s[sp.PD_ROLE]
            if role == PdRole.PREFILL:
                if e.pd_legs < 0:  # a decode leg waited for it: one caller for both legs, its wait answered
                    e.pd_legs += 1
                    e.callers -= 2
                else:  # a P/D request's first leg: its decode leg, and the caller, follow
                    e.pd_legs += 1
            elif (role == PdRole.DECODE and s[sp.PD_PEER_REQUEST_ID]) or (role == PdRole.BOTH and e.pd_legs > 0):
                # (a connector that names no peer, the disk connector's: its decode leg says both)
                if e.pd_legs > 0:  # its prefill leg is here: one caller for both legs
                    e.pd_legs -= 1
                    e.callers -= 1
                else:  # its prefill leg's span is still on its way (another process's exporter)
                    e.pd_legs -= 1
                    e.callers += 1
            if e.waiting is None:
                e.waiting = {}
            e.waiting[s[sp.SPAN_ID]] = now
            if e.callers > e.clients or e.pd_legs > 0:
                e.ready_at = now + self._peer_wait()
                self._peer.append((e.ready_at, tid))
                return
        # still waiting for a caller's span, for the decode leg of a prefill leg here (its client may
        # have given up first: the decode engine aborts the leg later), or for the engine span of a
        # cancelled client's: the peer deadline stands
        if e.callers > e.clients or e.pd_legs > 0 or e.cancelled > e.callers:
            return
        if e.id_until > now + self.config.grace_s:  # a GenAI client span waits for its engine's: that stands
            e.ready_at = e.id_until
            return
        e.ready_at = now + self.config.grace_s
        self._grace.append((e.ready_at, tid))

    def _release(self, tid: bytes, reason: str, now: float | None = None) -> ReleasedTrace | None:
        """Release ``tid``'s group. At a timeout (``now`` given), the engine spans still within
        their peer wait and unmatched are kept back as the trace's next group."""
        e = self._entries.pop(tid, None)
        if e is None:
            return None
        self._forget_ids(tid, e)
        spans = self.storage.pop(tid) or []
        held: list[tuple] = []
        if now is not None and e.waiting and spans:
            since = now - self._peer_wait()
            spans, held = _hold_back(spans, e.waiting, since, e.held or ())
        keys, requests = _released_keys(spans)
        self._released.add(tid, keys, requests)
        for s in e.moved_in or ():  # a retry of a span taken in by id comes in its own trace: late there
            own = s[sp.TRACE_ID]
            self._released.add(own, *_released_keys([s]))
            if (oe := self._entries.get(own)) is not None:  # its trace's group in flight reads it too
                oe.released = self._released.get(own)
        c = self.counters
        c.traces_released += 1
        if reason == "evicted":
            c.traces_evicted += 1
        elif reason == "grace":
            c.traces_released_grace += 1
        elif reason == "timeout":
            c.traces_released_timeout += 1
        kept = e.bytes * len(held) // max(1, len(spans) + len(held))
        self.bytes -= e.bytes - kept
        if held:
            self._hold(tid, held, e, kept, now)
        return ReleasedTrace(tid, spans, reason, e.bytes - kept)

    def _forget_ids(self, tid: bytes, e: _Entry) -> None:
        """Group ``tid`` is released: its engine spans and waiting client spans leave the id indexes."""
        for rid in e.rids or ():
            had = self._engine_by_id.get(rid)
            if had == tid:
                del self._engine_by_id[rid]
            elif type(had) is set:
                had.discard(tid)
                if not had:
                    del self._engine_by_id[rid]
        for rid, sid in e.id_clients or ():
            waiting = self._client_by_id.get(rid)
            if waiting and (tid, sid) in waiting:
                waiting.remove((tid, sid))
                if not waiting:
                    del self._client_by_id[rid]

    def _hold(self, tid: bytes, held: list[tuple], was: _Entry, held_bytes: int, now: float) -> None:
        """Open ``tid``'s next group with the spans a timeout kept back, due when their peer wait ends
        and at the latest one timeout from now. Each engine span is held back once: a timeout shorter
        than the peer wait releases it the next time, never holds it again and again."""
        e = self._entries[tid] = _Entry(now, self._released.get(tid), held=set(), spans=len(held), bytes=held_bytes)
        self._ring.append(tid)
        for s in held:
            self.storage.add(tid, s)
            if s[sp.CODE] == sp.GENAI_CLIENT and s[sp.SPAN_ID] in was.waiting:  # still waiting for its engine's
                at = was.waiting[s[sp.SPAN_ID]]
                e.held.add(s[sp.SPAN_ID])
                e.clients += 1
                self._client_waits(tid, e, s, at)
            elif s[sp.CODE] == sp.ENGINE and s[sp.SPAN_ID] in was.waiting:
                at = was.waiting[s[sp.SPAN_ID]]
                e.held.add(s[sp.SPAN_ID])
                if e.waiting is None:
                    e.waiting = {}
                e.waiting[s[sp.SPAN_ID]] = at
                e.callers += 1
                self._engine_in(tid, e, s, now)
        e.ready_at = max(e.waiting.values()) + self._peer_wait()
        self._peer.append((e.ready_at, tid))
        self.counters.spans_held_back += len(held)

    def _release_oldest(self, reason: str) -> ReleasedTrace | None:
        while self._ring:
            tid = self._ring.popleft()
            if tid in self._entries:
                return self._release(tid, reason)
        return None

    def expire(self, now: float) -> list[ReleasedTrace]:
        """Release every group whose grace period or timeout has passed."""
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
                    out.append(self._release(tid, "timeout", now))
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
