"""Turns raw recorder events into finished-request and engine-step records (off the hot path).

Event tuples (``mono`` = monotonic ns when the hook ran):

=========== =============================================================================
ARRIVAL     ``(ARRIVAL, mono, request_id, start_wall_ns|None, input_tokens|None, trace_headers|None, attrs|None)``
SCHEDULED   ``(SCHEDULED, mono, request_id)``: first scheduled, or scheduled again after a preemption
PREEMPTED   ``(PREEMPTED, mono, request_id, mode)``: ``mode`` is ``recompute`` or ``swap``
GENERATED   ``(GENERATED, mono, request_id, tokens)``: tokens produced inside the engine
TOKEN_OUT   ``(TOKEN_OUT, mono, request_id, tokens)``: output handed to the transport
FINISH      ``(FINISH, mono, request_id, status, reason|None)``: status ``ok|error|cancelled|rejected``
STEP        ``(STEP, mono_start, mono_end, index, batch, prefill_tokens, decode_tokens, preempted,
            kv_usage|None, gpu_handle|None)``
RAW         ``(RAW, mono, expander, payload)``: ``expander(tracker, mono, payload)`` unpacks an engine's
            own objects later, so that the hot path only keeps a reference
=========== =============================================================================

An engine without a separate GENERATED hook gets its token-out times used as generation times.
In-flight requests are bounded (``max_in_flight``): the oldest is evicted and counted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from otel_llm.clock import WallAnchor

from .recorder import ARRIVAL, FINISH, GENERATED, PREEMPTED, QUEUED, RAW, SCHEDULED, STEP, TOKEN_OUT


@dataclass
class FinishedRequest:
    """One request's engine-side life. Times are wall-clock ns."""

    request_id: str
    start_ns: int
    end_ns: int
    status: str
    finish_reason: str | None = None
    trace_headers: Mapping[str, str] | None = None
    input_tokens: int | None = None
    queued_ns: int | None = None  # the engine core's QUEUED event: the request entered the scheduler's queue
    first_scheduled_ns: int | None = None
    first_generated_ns: int | None = None
    last_generated_ns: int | None = None
    generated_tokens: int = 0
    preemptions: list[tuple[int, int, str]] = field(default_factory=list)  # (start, end, mode)
    preemption_tokens: list[int] = field(default_factory=list)  # each preemption's computed tokens then
    out_times_ns: list[int] = field(default_factory=list)
    out_tokens: list[int] = field(default_factory=list)
    # tokens generated inside the engine (an engine with a GENERATED hook): when, and how many
    gen_times_ns: list[int] = field(default_factory=list)
    gen_tokens: list[int] = field(default_factory=list)
    attrs: dict | None = None
    incomplete: bool = False  # still in flight at shutdown or eviction

    @property
    def output_tokens(self) -> int:
        return sum(self.out_tokens) if self.out_tokens else self.generated_tokens


@dataclass
class StepRecord:
    """One engine iteration. Times are wall-clock ns."""

    start_ns: int
    end_ns: int
    index: int
    batch_size: int
    prefill_tokens: int
    decode_tokens: int
    preempted: int
    kv_usage: float | None = None
    gpu_time_ns: int | None = None
    waiting: int | None = None  # requests left waiting after the step
    wait_reason: str | None = None  # why, as the engine says


class _Live:
    __slots__ = ("gen_seen", "open_preemption", "rec")

    def __init__(self, rec: FinishedRequest):
        self.rec = rec
        self.open_preemption: tuple[int, str, int] | None = None  # (start, mode, computed tokens)
        self.gen_seen = False


class RequestTracker:
    def __init__(
        self,
        anchor: WallAnchor | None = None,
        max_in_flight: int = 100_000,
        gpu_elapsed: Callable[[object], int | None] | None = None,
    ):
        self.anchor = anchor or WallAnchor()
        self.max_in_flight = max_in_flight
        self.gpu_elapsed = gpu_elapsed
        self.live: dict[str, _Live] = {}
        self.finished: list[FinishedRequest] = []
        self.steps: list[StepRecord] = []
        self.pending_gpu: list[tuple[StepRecord, object]] = []
        self.evicted = 0
        self.unknown_events = 0
        self.http_done: list = []  # engine_hooks.asgi.HttpRecord, finished

    # -- request lifecycle, wall-clock ns ---------------------------------------------------------
    def arrival(
        self,
        rid: str,
        wall_ns: int,
        start_ns: int | None = None,
        input_tokens: int | None = None,
        trace_headers: Mapping[str, str] | None = None,
        attrs: dict | None = None,
    ) -> None:
        if len(self.live) >= self.max_in_flight:
            old_id = next(iter(self.live))
            old = self.live.pop(old_id)
            self.evicted += 1
            self._close(old, wall_ns, "cancelled", "evicted", incomplete=True)
        start = start_ns if start_ns is not None else wall_ns
        self.live[rid] = _Live(
            FinishedRequest(
                rid, start, start, "ok", trace_headers=trace_headers, input_tokens=input_tokens, attrs=attrs
            )
        )

    def _get(self, rid: str) -> _Live | None:
        st = self.live.get(rid)
        if st is None:
            self.unknown_events += 1
        return st

    def queued(self, rid: str, wall_ns: int) -> None:
        """The request entered the scheduler's queue (the front end's own work before it is done)."""
        st = self._get(rid)
        if st is not None and st.rec.queued_ns is None:
            st.rec.queued_ns = wall_ns

    def scheduled(self, rid: str, wall_ns: int) -> None:
        st = self._get(rid)
        if st is None:
            return
        if st.rec.first_scheduled_ns is None:
            st.rec.first_scheduled_ns = wall_ns
        if st.open_preemption is not None:
            t0, mode, tokens = st.open_preemption
            st.rec.preemptions.append((t0, wall_ns, mode))
            st.rec.preemption_tokens.append(tokens)
            st.open_preemption = None

    def preempted(self, rid: str, wall_ns: int, mode: str = "recompute") -> None:
        st = self._get(rid)
        if st is not None and st.open_preemption is None:
            # what it had computed: its prompt and what it generated (a recompute does it again)
            st.open_preemption = (wall_ns, mode, (st.rec.input_tokens or 0) + st.rec.generated_tokens)

    def annotate(self, rid: str, attrs: dict) -> None:
        """More attributes of the request's span (what the engine says about it on the way)."""
        st = self._get(rid)
        if st is not None:
            st.rec.attrs = {**(st.rec.attrs or {}), **attrs}

    def generated(self, rid: str, wall_ns: int, tokens: int) -> None:
        st = self._get(rid)
        if st is None:
            return
        st.gen_seen = True
        self._gen(st.rec, wall_ns, tokens)
        if tokens > 0:
            st.rec.gen_times_ns.append(wall_ns)
            st.rec.gen_tokens.append(tokens)

    @staticmethod
    def _gen(rec: FinishedRequest, wall_ns: int, tokens: int) -> None:
        if rec.first_generated_ns is None:
            rec.first_generated_ns = wall_ns
        rec.last_generated_ns = wall_ns
        rec.generated_tokens += tokens

    def token_out(self, rid: str, wall_ns: int, tokens: int) -> None:
        st = self._get(rid)
        if st is None or tokens <= 0:
            return
        st.rec.out_times_ns.append(wall_ns)
        st.rec.out_tokens.append(tokens)
        if not st.gen_seen:
            self._gen(st.rec, wall_ns, tokens)

    def finish(self, rid: str, wall_ns: int, status: str, reason: str | None = None) -> None:
        st = self.live.pop(rid, None)
        if st is None:
            self.unknown_events += 1
            return
        self._close(st, wall_ns, status, reason)

    def _close(self, st: _Live, wall_ns: int, status: str, reason: str | None, incomplete: bool = False) -> None:
        rec = st.rec
        rec.end_ns = max(wall_ns, rec.start_ns)
        rec.status = status
        rec.finish_reason = reason
        rec.incomplete = incomplete
        if st.open_preemption is not None:
            t0, mode, tokens = st.open_preemption
            rec.preemptions.append((t0, rec.end_ns, mode))
            rec.preemption_tokens.append(tokens)
        self.finished.append(rec)

    def close_all(self, wall_ns: int) -> None:
        """Shutdown: every request still in flight ends now, marked incomplete and cancelled."""
        for rid in list(self.live):
            self._close(self.live.pop(rid), wall_ns, "cancelled", "shutdown", incomplete=True)

    # -- steps --------------------------------------------------------------------------------------
    def step(
        self,
        start_ns: int,
        end_ns: int,
        index: int,
        batch: int,
        prefill: int,
        decode: int,
        preempted: int,
        kv_usage: float | None,
        gpu_handle: object | None,
        waiting: tuple | None = None,
    ) -> None:
        rec = StepRecord(start_ns, end_ns, index, batch, prefill, decode, preempted, kv_usage)
        if waiting is not None:
            rec.waiting, rec.wait_reason = waiting
        if gpu_handle is not None and (self.gpu_elapsed is not None or type(gpu_handle) is tuple):
            self.pending_gpu.append((rec, gpu_handle))
        else:
            self.steps.append(rec)

    def resolve_gpu(self, force: bool = False) -> None:
        """Read back GPU times whose events have completed (``force``: give up on the rest)."""
        still = []
        for rec, handle in self.pending_gpu:
            if type(handle) is tuple:  # (the timer that recorded it, its handle)
                ns = handle[0].elapsed_ns(handle[1])
            else:
                ns = self.gpu_elapsed(handle) if self.gpu_elapsed else None
            if ns is None and not force:
                still.append((rec, handle))
                continue
            rec.gpu_time_ns = ns
            self.steps.append(rec)
        self.pending_gpu = still

    # -- raw events ---------------------------------------------------------------------------------
    def feed(self, events: list[tuple]) -> None:
        wall = self.anchor.wall_ns
        for ev in events:
            kind = ev[0]
            if kind == RAW:
                ev[2](self, ev[1], ev[3])
            elif kind == TOKEN_OUT:
                self.token_out(ev[2], wall(ev[1]), ev[3])
            elif kind == GENERATED:
                self.generated(ev[2], wall(ev[1]), ev[3])
            elif kind == STEP:
                self.step(wall(ev[1]), wall(ev[2]), *ev[3:])
            elif kind == ARRIVAL:
                self.arrival(ev[2], wall(ev[1]), *ev[3:])
            elif kind == SCHEDULED:
                self.scheduled(ev[2], wall(ev[1]))
            elif kind == PREEMPTED:
                self.preempted(ev[2], wall(ev[1]), ev[3])
            elif kind == FINISH:
                self.finish(ev[2], wall(ev[1]), ev[3], ev[4])
            elif kind == QUEUED:
                self.queued(ev[2], wall(ev[1]))

    def take_http(self) -> list:
        h, self.http_done = self.http_done, []
        return h

    def take(self) -> tuple[list[FinishedRequest], list[StepRecord]]:
        f, s = self.finished, self.steps
        self.finished, self.steps = [], []
        return f, s
