"""Turns raw recorder events into finished-request and engine-step records (off the hot path).

It reads the hook events of :mod:`engine_hooks.hot_path.hook_events` (:meth:`RequestTracker.feed`): one
handler each, ``_on_<name>``, whose parameters are the event's fields by name.

An engine without a separate GENERATED hook gets its token-out times used as generation times.
In-flight requests are bounded (``max_in_flight``): the oldest is evicted and counted.

A batching engine hands out tokens for every running request at every step, so
:meth:`RequestTracker.emitted` takes a whole step at once and does one C-level append per request:
the step's index and the request's token count, packed into one int64 (``step << 20 | tokens``),
onto that request's array; the step's two times go once onto the tracker's step arrays. Steady
decoding gives the same requests one token each, step after step: such a run of steps costs
nothing per request while it lasts (the batch is compared with the last one, in C), and when it
ends each of its requests gets one entry for all of it (``-(first step << 20 | steps)``). The
request's token events are unpacked with numpy when it finishes (:meth:`RequestTracker._unpack`).
The step arrays are trimmed to what requests still in flight refer to.
"""

from __future__ import annotations

import logging
from array import array
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import call

import numpy as np

from otel_llm.clock import WallAnchor
from otel_llm.semconv import RequestStatus

from ..hot_path.hook_events import EVENTS
from .kv_fetch import KvFetchBook, KvHoldBook, KvTransportBook
from .speculation import SpeculationBook

log = logging.getLogger("engine_hooks")


@dataclass(slots=True)
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
    # the sequences below are an empty tuple until the tracker first appends (one record per request:
    # seven empty containers made for each cost more than the rest of its arrival)
    preemptions: list[tuple[int, int, str]] | tuple = ()  # (start, end, mode)
    preemption_tokens: list[int] | tuple = ()  # each preemption's computed tokens then
    preemption_kv: list[float | None] | tuple = ()  # each one's KV cache usage then
    # token events, int64 arrays (a list works as well): when output was handed out, and how many tokens
    out_times_ns: array | np.ndarray | tuple = ()
    out_tokens: array | np.ndarray | tuple = ()
    # tokens generated inside the engine (an engine with a GENERATED hook): when, and how many
    gen_times_ns: array | np.ndarray | tuple = ()
    gen_tokens: array | np.ndarray | tuple = ()
    attrs: dict | None = None
    incomplete: bool = False  # still in flight at shutdown or eviction
    # an aborted request (status cancelled): tokens the engine generated for it after the abort,
    # which nobody received (counted for the abort grace after it); None for any other request
    tokens_after_abort: int | None = None

    @property
    def output_tokens(self) -> int:
        t = self.out_tokens
        if not len(t):
            return self.generated_tokens
        return sum(t) if type(t) is array else int(np.sum(t))  # an array's sum in C: no numpy call


@dataclass
class PreemptionRecord:
    """A preemption of a request this process does not trace (vLLM's engine core: its requests'
    spans come from the front end), as the engine said it. Times are wall-clock ns."""

    request_id: str
    time_ns: int
    mode: str
    kv_usage: float | None
    recompute_tokens: int | None


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
    draft_tokens: int | None = None  # speculative decoding: draft tokens verified (None: none)
    accepted_tokens: int | None = None  # of them, accepted


@dataclass(slots=True)
class HttpRecord:
    """One HTTP request at the server (:mod:`engine_hooks.asgi`). Times are monotonic ns of the
    server's process.

    The middleware hands it on as the plain tuple of its fields in this order, with the chunk
    times as the bytes of their int64s (:meth:`from_wire` makes the record): built as a tuple on
    the event loop, it crosses to the span process as one (a dataclass pickled through
    ``__reduce__`` and an array's took three times the instructions)."""

    start_mono: int  # the server began reading the request (else: the app was called)
    end_mono: int
    method: str
    path: str
    status: int | None
    response_start_mono: int | None
    chunk_mono: array = field(default_factory=lambda: array("q"))  # int64
    trace_id: bytes = b""
    span_id: bytes = b""
    parent_span_id: bytes | None = None
    parent_flags: int = 1
    sampled: bool = True  # the sampler's decision (OTEL_TRACES_SAMPLER), handed on in the traceparent
    probability: float | None = None  # what it kept the request with, where it decided itself
    app_start_mono: int = 0  # the app (this middleware) was called

    @classmethod
    def from_wire(cls, t: tuple) -> HttpRecord:
        """The record of the tuple the middleware handed on."""
        chunks = array("q")
        chunks.frombytes(t[_HTTP_CHUNKS])
        return cls(*t[:_HTTP_CHUNKS], chunks, *t[_HTTP_CHUNKS + 1 :])

    def to_wire(self) -> tuple:
        """The tuple :meth:`from_wire` takes."""
        t = tuple(getattr(self, f) for f in self.__dataclass_fields__)
        return t[:_HTTP_CHUNKS] + (t[_HTTP_CHUNKS].tobytes(),) + t[_HTTP_CHUNKS + 1 :]


_HTTP_CHUNKS = tuple(HttpRecord.__dataclass_fields__).index("chunk_mono")


_TOKEN_BITS = 20  # a packed step entry: step index << 20 | tokens; 43 bits of steps
_TOKEN_MASK = (1 << _TOKEN_BITS) - 1  # as tokens: "more than fit", the count is in _Live.big
# a run entry (below zero): -(first step << 20 | steps), one token at each; at most _TOKEN_MASK steps


_ONE = array("q", [1])


def _entry_step(entry: int) -> int:
    """The (first) step of a packed entry."""
    return (-entry if entry < 0 else entry) >> _TOKEN_BITS


class _Live:
    __slots__ = ("big", "gen_seen", "open_preemption", "packed", "rec")

    def __init__(self, rec: FinishedRequest):
        self.rec = rec
        # (start, mode, computed tokens, KV usage or None)
        self.open_preemption: tuple[int, str, int, float | None] | None = None
        self.gen_seen = False
        self.packed = array("q")  # the steps that gave it tokens (RequestTracker.emitted), packed
        self.big: list[int] = []  # in order, the counts of its entries marked _TOKEN_MASK

    def packed_steps(self) -> tuple[np.ndarray, np.ndarray]:
        """(step number, tokens) of every step its packed entries stand for, in step order."""
        p = np.frombuffer(self.packed, dtype=np.int64)
        runs = p < 0
        if not runs.any():
            n = p & _TOKEN_MASK  # copies: the view ends here
            if self.big:
                n[n == _TOKEN_MASK] = self.big
            return p >> _TOKEN_BITS, n
        q = np.where(runs, -p, p)
        first, low = q >> _TOKEN_BITS, q & _TOKEN_MASK  # low: a run's steps, another entry's tokens
        if self.big:
            low[~runs & (low == _TOKEN_MASK)] = self.big
        span = np.where(runs, low, 1)  # steps per entry
        starts = np.cumsum(span) - span
        steps = np.arange(int(span.sum()), dtype=np.int64) - np.repeat(starts - first, span)
        n = np.repeat(np.where(runs, 1, low), span)
        if len(steps) > 1 and (steps[1:] < steps[:-1]).any():  # one request twice in a batch
            order = np.argsort(steps, kind="stable")
            steps, n = steps[order], n[order]
        return steps, n


class RequestTracker:
    def __init__(
        self,
        anchor: WallAnchor | None = None,
        max_in_flight: int = 100_000,
        gpu_elapsed: Callable[[object], int | None] | None = None,
        abort_grace_ns: int = 1_000_000_000,
    ):
        self.anchor = anchor or WallAnchor()
        # an aborted request is held this long (wall ns) after its abort, counting the tokens its
        # engine still makes for it (a step already under way, the abort not yet arrived)
        self.abort_grace_ns = abort_grace_ns
        self._aborted: dict[str, tuple[FinishedRequest, int]] = {}  # request id -> (record, release at)
        self.tokens_after_abort = 0  # all requests, so far
        self.max_in_flight = max_in_flight
        self.gpu_elapsed = gpu_elapsed
        self.live: dict[str, _Live] = {}
        self.finished: list[FinishedRequest] = []
        self.steps: list[StepRecord] = []
        self.preemptions: list[PreemptionRecord] = []  # of requests not traced here (bounded)
        self.speculation = SpeculationBook(max_in_flight)  # speculative decoding, request by request
        self.kv_fetches = KvFetchBook(max_in_flight)  # a decode engine's KV fetches (disaggregated P/D)
        self.kv_holds = KvHoldBook(max_in_flight)  # a prefill engine's KV blocks held for the decode side
        self.kv_transports = KvTransportBook(max_in_flight)  # what the connector's transport said, per request
        self.pending_gpu: list[tuple[StepRecord, object]] = []
        self.evicted = 0
        self.unknown_events = 0
        self.failed_expansions = 0  # RAW events whose expander raised (each lost alone)
        self.http_done: list[tuple] = []  # HttpRecord.to_wire()'s tuples, as the middleware hands them on
        # batch steps (emitted): the wall ns each step's tokens were generated and handed out,
        # the first kept being step number ``_step_base``; and each live request's packed append
        self._step_gen = array("q")
        self._step_out = array("q")
        self._step_base = 0
        self._appenders: dict[str, Callable[[int], None]] = {}
        self._unknown: list[int] = []  # packed entries of steps for requests not in flight
        # the last step's batch if it got one token each, and the run under way of steps that gave
        # that batch one token each again: its first step and its length (0: none open)
        self._batch: list[str] | None = None
        self._run_first = 0
        self._run_len = 0
        # each kind of hook event's handler (feed)
        self._handlers = {e.kind: getattr(self, f"_on_{e.name}") for e in EVENTS}

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
        if rid in self.live:  # the same id again: what the run gave so far is the old one's
            self._flush_run()
        if len(self.live) >= self.max_in_flight:
            old = self._end_live(next(iter(self.live)))
            self.evicted += 1
            self._close(old, wall_ns, RequestStatus.CANCELLED, "evicted", incomplete=True)
        start = start_ns if start_ns is not None else wall_ns
        st = self.live[rid] = _Live(
            FinishedRequest(
                rid, start, start, RequestStatus.OK, trace_headers=trace_headers, input_tokens=input_tokens, attrs=attrs
            )
        )
        self._appenders[rid] = st.packed.append

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
            self._end_preemption(st, wall_ns)

    @staticmethod
    def _end_preemption(st: _Live, wall_ns: int) -> None:
        t0, mode, tokens, kv = st.open_preemption
        rec = st.rec
        if not rec.preemptions:
            rec.preemptions, rec.preemption_tokens, rec.preemption_kv = [], [], []
        rec.preemptions.append((t0, wall_ns, mode))
        rec.preemption_tokens.append(tokens)
        rec.preemption_kv.append(kv)
        st.open_preemption = None

    def preempted(
        self,
        rid: str,
        wall_ns: int,
        mode: str = "recompute",
        kv_usage: float | None = None,
        recompute_tokens: int | None = None,
    ) -> None:
        st = self.live.get(rid)
        if st is None:
            if kv_usage is None and recompute_tokens is None:
                self.unknown_events += 1
            elif len(self.preemptions) < self.max_in_flight:  # traced elsewhere: said on its own
                self.preemptions.append(PreemptionRecord(rid, wall_ns, mode, kv_usage, recompute_tokens))
            return
        if st.open_preemption is None:
            if recompute_tokens is None:
                # the tokens whose KV it held, which a recompute computes again: its prompt and every
                # token it generated but the newest (whose KV the next step would have written)
                self._flush_run()
                generated = st.rec.generated_tokens + int(st.packed_steps()[1].sum())
                recompute_tokens = (st.rec.input_tokens or 0) + max(generated - 1, 0)
            st.open_preemption = (wall_ns, mode, recompute_tokens, kv_usage)

    def annotate(self, rid: str, attrs: dict) -> None:
        """More attributes of the request's span (what the engine says about it on the way)."""
        st = self._get(rid)
        if st is not None:
            st.rec.attrs = {**(st.rec.attrs or {}), **attrs}

    def generated(self, rid: str, wall_ns: int, tokens: int) -> None:
        st = self.live.get(rid)
        if st is None:
            self._after_end(rid, tokens)
            return
        if tokens <= 0:  # no token (as token_out and emitted take it)
            return
        st.gen_seen = True
        self._gen(st.rec, wall_ns, tokens)
        rec = st.rec
        if not len(rec.gen_times_ns):
            rec.gen_times_ns, rec.gen_tokens = array("q"), array("q")
        rec.gen_times_ns.append(wall_ns)
        rec.gen_tokens.append(tokens)

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
        rec = st.rec
        if not len(rec.out_times_ns):
            rec.out_times_ns, rec.out_tokens = array("q"), array("q")
        rec.out_times_ns.append(wall_ns)
        rec.out_tokens.append(tokens)
        if not st.gen_seen:
            self._gen(st.rec, wall_ns, tokens)

    def emitted(self, request_ids: Sequence[str], tokens: Sequence[int] | None, gen_ns: int, out_ns: int) -> None:
        """One engine step's tokens for many requests at once: ``tokens[i]`` for ``request_ids[i]``
        (``tokens`` None: one each), generated at ``gen_ns`` and handed out at ``out_ns``
        (wall-clock ns). The same as :meth:`generated` then :meth:`token_out` for each request with
        tokens; this runs for every running request at every step, so it is one packed append per
        request, in C; and nothing at all per request from the second step on that gives the same
        batch one token each (a run, :meth:`_flush_run`)."""
        k = self._step_base + len(self._step_gen)
        self._step_gen.append(gen_ns)
        self._step_out.append(out_ns)
        ones = tokens is None or tokens.count(1) == len(tokens)
        if ones:
            tokens = None
        if ones and request_ids and request_ids == self._batch:
            if self._run_len:
                if self._run_len < _TOKEN_MASK:
                    self._run_len += 1  # the run goes on
                    return
                self._flush_run()  # as long as a run entry holds: another from here
            if all(map(self._appenders.__contains__, request_ids)):  # a run starts
                self._run_first, self._run_len = k, 1
                return
        else:
            self._flush_run()
            self._batch = list(request_ids) if ones else None  # a copy: the caller's list may change
        if tokens and (max(tokens) >= _TOKEN_MASK or min(tokens) < 0):  # 2^20 tokens or more in a step, or < 0
            self._emit_big(request_ids, tokens, k)
            return
        base = k << _TOKEN_BITS
        unknown = self._unknown
        entries = repeat(base + 1) if ones else map(base.__add__, tokens)  # mostly 1 each
        deque(map(call, map(self._appenders.get, request_ids, repeat(unknown.append)), entries), 0)
        if unknown:
            unknown.clear()
            live = self._appenders
            for rid, n in zip(request_ids, tokens or repeat(1)):
                if rid not in live:
                    self._after_end(rid, n)

    def _flush_run(self) -> None:
        """Give each request of the run under way its entry for it, before anything reads their
        entries (:meth:`_end_live`, :meth:`preempted`); the batch is kept, for a run that starts
        again with it. A run's requests are all in flight when it starts, and it ends before one
        of them leaves."""
        n = self._run_len
        if not n:
            return
        self._run_len = 0
        entry = -((self._run_first << _TOKEN_BITS) | n)
        deque(map(call, map(self._appenders.__getitem__, self._batch), repeat(entry)), 0)

    def _emit_big(self, request_ids: Sequence[str], tokens: Sequence[int], k: int) -> None:
        """:meth:`emitted`, for a step with more tokens for a request than an entry holds (or a
        count below zero, which is no token)."""
        base = k << _TOKEN_BITS
        for rid, n in zip(request_ids, tokens):
            st = self.live.get(rid)
            if st is None:
                self._after_end(rid, n)
            elif n <= 0:
                continue
            elif n >= _TOKEN_MASK:
                st.packed.append(base | _TOKEN_MASK)
                st.big.append(n)
            else:
                st.packed.append(base + n)

    def _after_end(self, rid: str, tokens: int) -> None:
        """Tokens for a request not in flight: made after its abort (it is held), else unknown."""
        held = self._aborted.get(rid)
        if held is None:
            self.unknown_events += 1
        elif tokens > 0:
            held[0].tokens_after_abort += tokens
            self.tokens_after_abort += tokens

    def release_aborted(self, wall_ns: int | None = None) -> None:
        """Aborted requests whose grace has passed at ``wall_ns`` (all of them: None) are finished."""
        if not self._aborted:
            return
        keep = {}
        for rid, (rec, at) in self._aborted.items():
            if wall_ns is None or at <= wall_ns:
                self.finished.append(rec)
            else:
                keep[rid] = (rec, at)
        self._aborted = keep

    def _unpack(self, st: _Live) -> None:
        """Move a request's packed step entries into its record's token events (int64 arrays)."""
        if not st.packed or self._unpack_in_order(st):
            return
        steps, n = st.packed_steps()
        idx = steps - self._step_base
        keep = n > 0
        if not keep.all():
            n, idx = n[keep], idx[keep]
        gen = np.frombuffer(self._step_gen, dtype=np.int64)[idx]
        out = np.frombuffer(self._step_out, dtype=np.int64)[idx]  # copies: the views end here
        st.packed, st.big = array("q"), []
        if not len(n):
            return
        rec = st.rec
        if rec.first_generated_ns is None or gen[0] < rec.first_generated_ns:
            rec.first_generated_ns = int(gen[0])
        rec.last_generated_ns = max(int(gen[-1]), rec.last_generated_ns or 0)
        rec.generated_tokens += int(n.sum())
        if len(rec.out_times_ns) or len(rec.gen_times_ns):  # other token events too: merge, in time order
            out, n_out = _merged(rec.out_times_ns, rec.out_tokens, out, n)
            gen, n = _merged(rec.gen_times_ns, rec.gen_tokens, gen, n)
        else:
            n_out = n
        rec.out_times_ns, rec.out_tokens, rec.gen_times_ns, rec.gen_tokens = out, n_out, gen, n

    def _unpack_in_order(self, st: _Live) -> bool:
        """:meth:`_unpack` for what nearly every request is: entries in step order, each count
        under ``_TOKEN_MASK``, no token events from other hooks. Slices of the step arrays (C
        copies), a few Python operations per entry (a steady request has two or three); False,
        having changed nothing, for anything else (numpy then)."""
        rec = st.rec
        if st.big or len(rec.out_times_ns) or len(rec.gen_times_ns):
            return False
        base, sg, so = self._step_base, self._step_gen, self._step_out
        gen, out, n = array("q"), array("q"), array("q")
        last = -1
        for e in st.packed:
            if e < 0:  # a run: one token at each of its steps
                e = -e
                k, steps = (e >> _TOKEN_BITS) - base, e & _TOKEN_MASK
                if k <= last:
                    return False
                gen += sg[k : k + steps]
                out += so[k : k + steps]
                n += _ONE * steps
                last = k + steps - 1
            else:
                k, c = (e >> _TOKEN_BITS) - base, e & _TOKEN_MASK
                if k <= last:
                    return False
                last = k
                if c:
                    gen.append(sg[k])
                    out.append(so[k])
                    n.append(c)
        st.packed, st.big = array("q"), []
        if not n:
            return True
        if rec.first_generated_ns is None or gen[0] < rec.first_generated_ns:
            rec.first_generated_ns = gen[0]
        rec.last_generated_ns = max(gen[-1], rec.last_generated_ns or 0)
        rec.generated_tokens += sum(n)
        rec.out_times_ns, rec.out_tokens, rec.gen_times_ns, rec.gen_tokens = out, n, gen, n
        return True

    def _trim_steps(self) -> None:
        """Forget the batch steps no request in flight refers to (amortised: when the arrays have
        doubled since the last trim). Called as a request closes, when no run is under way."""
        firsts = [_entry_step(st.packed[0]) for st in self.live.values() if st.packed]
        keep_from = min(firsts) if firsts else self._step_base + len(self._step_gen)
        cut = keep_from - self._step_base
        if cut > 0:
            del self._step_gen[:cut]
            del self._step_out[:cut]
            self._step_base = keep_from
        self._trim_at = max(4096, 2 * len(self._step_gen))

    _trim_at = 4096

    def _end_live(self, rid: str) -> _Live | None:
        """Take a request out of flight (and out of :meth:`emitted`'s lookup), with what the run
        under way gave it."""
        self._flush_run()
        self._appenders.pop(rid, None)
        return self.live.pop(rid, None)

    def finish(self, rid: str, wall_ns: int, status: str, reason: str | None = None) -> None:
        st = self._end_live(rid)
        if st is None:
            self.unknown_events += 1
            return
        self._close(st, wall_ns, status, reason)

    def _close(self, st: _Live, wall_ns: int, status: str, reason: str | None, incomplete: bool = False) -> None:
        self._unpack(st)
        if len(self._step_gen) >= self._trim_at:
            self._trim_steps()
        rec = st.rec
        rec.end_ns = max(wall_ns, rec.start_ns)
        rec.status = status
        rec.finish_reason = reason
        rec.incomplete = incomplete
        if st.open_preemption is not None:
            self._end_preemption(st, rec.end_ns)
        if status == RequestStatus.CANCELLED and not incomplete and self.abort_grace_ns > 0:
            rec.tokens_after_abort = 0  # held: what the engine still makes for it is counted
            if len(self._aborted) >= self.max_in_flight:  # bounded: the oldest goes now
                oldest = next(iter(self._aborted))
                self.finished.append(self._aborted.pop(oldest)[0])
            self._aborted[rec.request_id] = (rec, rec.end_ns + self.abort_grace_ns)
            return
        self.finished.append(rec)

    def close_all(self, wall_ns: int) -> None:
        """Shutdown: every request still in flight ends now, marked incomplete and cancelled."""
        for rid in list(self.live):
            self._close(self._end_live(rid), wall_ns, RequestStatus.CANCELLED, "shutdown", incomplete=True)
        self.release_aborted()
        self.speculation.close_all()
        self.kv_fetches.close_all(wall_ns)
        self.kv_holds.close_all(wall_ns)
        self.kv_transports.close_all()

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
        speculation: tuple | None = None,
    ) -> None:
        rec = StepRecord(start_ns, end_ns, index, batch, prefill, decode, preempted, kv_usage)
        if waiting is not None:
            rec.waiting, rec.wait_reason = waiting
        if speculation is not None:
            rec.draft_tokens, rec.accepted_tokens = speculation
        if type(gpu_handle) is int:  # read back already (the engine's process, for a span process): ns, or -1
            rec.gpu_time_ns = gpu_handle if gpu_handle >= 0 else None
            self.steps.append(rec)
        elif gpu_handle is not None and (self.gpu_elapsed is not None or type(gpu_handle) is tuple):
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
        """Take recorded hook events, in order: each to its kind's handler (an unknown kind is
        counted in ``unknown_events``)."""
        handlers = self._handlers
        for ev in events:
            handler = handlers.get(ev[0])
            if handler is None:
                self.unknown_events += 1
            else:
                handler(*ev[1:])

    # the handlers: one per kind of hook event, its fields by name (engine_hooks.hot_path.hook_events)
    def _on_arrival(self, mono, request_id, start_mono, input_tokens, trace_headers, attrs) -> None:
        wall = self.anchor.wall_ns
        start = None if start_mono is None else wall(start_mono)
        self.arrival(request_id, wall(mono), start, input_tokens, trace_headers, attrs)

    def _on_queued(self, mono, request_id) -> None:
        self.queued(request_id, self.anchor.wall_ns(mono))

    def _on_scheduled(self, mono, request_id) -> None:
        self.scheduled(request_id, self.anchor.wall_ns(mono))

    def _on_preempted(self, mono, request_id, mode, kv_usage=None, recompute_tokens=None) -> None:
        self.preempted(request_id, self.anchor.wall_ns(mono), mode, kv_usage, recompute_tokens)

    def _on_generated(self, mono, request_id, tokens) -> None:
        self.generated(request_id, self.anchor.wall_ns(mono), tokens)

    def _on_token_out(self, mono, request_id, tokens) -> None:
        self.token_out(request_id, self.anchor.wall_ns(mono), tokens)

    def _on_finish(self, mono, request_id, status, reason=None) -> None:
        self.finish(request_id, self.anchor.wall_ns(mono), status, reason)

    def _on_step(
        self,
        start_mono,
        end_mono,
        index,
        batch,
        prefill_tokens,
        decode_tokens,
        preempted,
        kv_usage=None,
        gpu_handle=None,
        waiting=None,
        speculation=None,
    ) -> None:
        wall = self.anchor.wall_ns
        self.step(
            wall(start_mono),
            wall(end_mono),
            index,
            batch,
            prefill_tokens,
            decode_tokens,
            preempted,
            kv_usage,
            gpu_handle,
            waiting,
            speculation,
        )

    def _on_raw(self, mono, expander, payload) -> None:
        expand(self, mono, expander, payload, True)

    def _on_plain_raw(self, mono, expander, payload) -> None:
        expand(self, mono, expander, payload, False)

    def take_preemptions(self) -> list[PreemptionRecord]:
        p, self.preemptions = self.preemptions, []
        return p

    def take_http(self) -> list[HttpRecord]:
        h, self.http_done = self.http_done, []
        return list(map(HttpRecord.from_wire, h))

    def take(self) -> tuple[list[FinishedRequest], list[StepRecord]]:
        f, s = self.finished, self.steps
        self.finished, self.steps = [], []
        return f, s


def _merged(times, tokens, more_times: np.ndarray, more_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two sets of token events as one, in time order (ties keep the first set first)."""
    t = np.concatenate([np.asarray(times, dtype=np.int64), more_times])
    n = np.concatenate([np.asarray(tokens, dtype=np.int64), more_tokens])
    order = np.argsort(t, kind="stable")
    return t[order], n[order]


def expand(target, mono: int, expander: Callable, payload, raw: bool) -> None:
    """One RAW (``raw``: its payload made plain first, where the expander has a ``to_plain``) or
    PLAIN_RAW event's ``expander`` run on ``target``: a tracker, or the span process's stand-in
    for one in the engine's process (:class:`engine_hooks.span_process.parent.CallRecorder`).
    One that fails costs its own event only (:func:`expansion_failed`)."""
    try:
        if raw and (to_plain := getattr(expander, "to_plain", None)) is not None:
            payload = to_plain(payload)
        expander(target, mono, payload)
    except Exception as exc:  # one engine object its expander could not read: the rest go on
        expansion_failed(target, exc)


def expansion_failed(target, exc: Exception) -> None:
    """An expander (or its ``to_plain``) raised: counted in ``target.failed_expansions``, said once."""
    target.failed_expansions += 1
    if target.failed_expansions == 1:
        why = f"{type(exc).__name__}: {exc}"
        log.warning("engine_hooks: unpacking an engine's event failed (%s); the others go on", why)
