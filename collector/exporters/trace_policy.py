"""``--forward-traces-policy``: forward to Jaeger (or another collector) only the traces worth
looking at, each one whole; the derived metrics still use every span received.

A policy is a comma-separated list of rules; a trace is forwarded when any rule keeps it:

* ``error``: a request of the trace did not complete (status error, cancelled or rejected);
* ``slo``: a completed request of the trace missed a bound of a configured SLO (``--slo``);
* ``stall``: a request of the trace stalled (its largest gap between tokens, ``--stall-threshold``);
* ``ratio=F``: a share F of the other traces, chosen by trace id (the same traces at every
  collector: the trace id's low 64 bits below F x 2^64, the SDK's ``TraceIdRatioBased`` rule);
* ``all``: every trace (what ``--forward-traces`` alone does, without waiting for verdicts).

How: each accepted export request is parsed (protobuf, on this module's own thread, never the
receiver's) and its spans held per trace, bounded in bytes. Derivation hands over a verdict per
trace it derived (:meth:`PolicyForwarder.verdicts`); the held spans of a kept trace are sent as
one export request, those of a dropped one are let go. Spans that arrive after their trace's
verdict follow it (verdicts are remembered, boundedly). A trace never derived (engine step traces,
spans the collector could not assemble) is decided by the ratio alone after ``hold_s``; when the
held bytes exceed their bound, the oldest traces are decided so, early, and counted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from otel_llm.otlp.otlp_encode import export_request_bytes, length_delimited
from otel_llm.semconv import RequestStatus

from ..config import TracePolicy

log = logging.getLogger("collector")

#: what one held span costs beyond its serialized bytes (the tuple, the bytes object's header)
_PART_OVERHEAD = 120


@dataclass
class _Held:
    first_seen: float
    size: int = 0
    parts: list = field(default_factory=list)  # (resource bytes, scope bytes, span bytes): serialized


class PolicyForwarder:
    """Holds spans per trace until their verdict, then hands the kept traces, whole, to ``sink``
    (an :class:`~collector.exporters.otlp_forward.OTLPForwarder`): its ``submit(bytes)`` takes one
    serialized ``ExportTraceServiceRequest``."""

    def __init__(
        self,
        policy: TracePolicy,
        sink,
        max_held_bytes: int = 64 << 20,
        hold_s: float = 60.0,
        max_verdicts: int = 200_000,
        max_queue: int = 10_000,
        max_queued_bytes: int = 64 << 20,
    ):
        self.policy, self.sink = policy, sink
        self.max_held_bytes, self.hold_s, self.max_verdicts = max_held_bytes, hold_s, max_verdicts
        self._held: OrderedDict[bytes, _Held] = OrderedDict()
        self._verdicts: OrderedDict[bytes, bool] = OrderedDict()
        self._held_bytes = 0
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue(max_queue)
        self.max_queued_bytes = max_queued_bytes
        self._queued_bytes = 0  # bodies waiting to be parsed: at most max_queued_bytes
        self._q_lock = threading.Lock()
        self.traces_forwarded = self.traces_dropped = self.decided_early = self.bodies_dropped = 0
        self.parse_errors = 0
        self._thread = threading.Thread(target=self._run, name="forward-policy", daemon=True)

    # -- what the receivers and derivation call ---------------------------------------------------
    def submit(self, body: bytes) -> None:
        """One accepted export request (protobuf): parsed later, on this forwarder's thread. The
        bodies waiting hold at most ``max_queued_bytes`` (beyond: dropped, counted)."""
        with self._q_lock:
            if self._queued_bytes + len(body) > self.max_queued_bytes:
                self.bodies_dropped += 1
                return
            self._queued_bytes += len(body)
        try:
            self._q.put_nowait(body)
        except queue.Full:
            with self._q_lock:
                self._queued_bytes -= len(body)
            self.bodies_dropped += 1

    def verdicts(self, decided: dict[bytes, bool]) -> None:
        """Derivation's verdicts, trace id -> keep (before the ratio rule: ratio applies to the
        traces no other rule keeps)."""
        with self._lock:
            for tid, keep in decided.items():
                keep = keep or self.policy.all or self.policy.by_ratio(tid)
                self._verdicts[tid] = keep
                self._verdicts.move_to_end(tid)
                held = self._held.pop(tid, None)
                if held is not None:
                    self._held_bytes -= held.size
                    self._settle(tid, held, keep)
            while len(self._verdicts) > self.max_verdicts:
                self._verdicts.popitem(last=False)

    def expire(self, now: float | None = None) -> None:
        """Traces held past ``hold_s`` with no verdict: by the ratio alone."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._held:
                tid, held = next(iter(self._held.items()))
                if now - held.first_seen < self.hold_s:
                    break
                self._held.popitem(last=False)
                self._held_bytes -= held.size
                self._settle(tid, held, self.policy.all or self.policy.by_ratio(tid))

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        while True:
            body = self._q.get()
            if body is None:
                return
            with self._q_lock:
                self._queued_bytes -= len(body)
            req = ExportTraceServiceRequest()
            try:
                req.ParseFromString(body)
            except Exception:
                self.parse_errors += 1
                continue
            # held as bytes, what is counted: parsed messages took several times their size
            by_trace: dict[bytes, list] = {}
            for rs in req.resource_spans:
                resource = rs.resource.SerializeToString(deterministic=True)
                for ss in rs.scope_spans:
                    scope = ss.scope.SerializeToString(deterministic=True)
                    for span in ss.spans:
                        by_trace.setdefault(span.trace_id, []).append((resource, scope, span.SerializeToString()))
            del req
            now = time.monotonic()
            with self._lock:
                for tid, parts in by_trace.items():
                    self._hold(tid, parts, now)
                self._bound()

    def _hold(self, tid: bytes, parts: list, now: float) -> None:
        verdict = self._verdicts.get(tid)
        if verdict is not None:  # decided already (derivation ran ahead of this thread, or late spans)
            if verdict:
                self._send(tid, parts)
            return
        held = self._held.get(tid)
        if held is None:
            held = self._held[tid] = _Held(now)
        size = sum(len(span) + _PART_OVERHEAD for _, _, span in parts)
        held.parts.extend(parts)
        held.size += size
        self._held_bytes += size

    def _bound(self) -> None:
        while self._held_bytes > self.max_held_bytes and self._held:
            tid, held = self._held.popitem(last=False)
            self._held_bytes -= held.size
            self.decided_early += 1
            self._settle(tid, held, self.policy.all or self.policy.by_ratio(tid))

    def _settle(self, tid: bytes, held: _Held, keep: bool) -> None:
        if keep:
            self._send(tid, held.parts)
            self.traces_forwarded += 1
        else:
            self.traces_dropped += 1

    def _send(self, tid: bytes, parts: list) -> None:
        """One ExportTraceServiceRequest of the trace's spans, grouped by resource and scope,
        written at the wire level from the held bytes."""
        groups: dict[bytes, dict[bytes, list[bytes]]] = {}
        for resource, scope, span in parts:  # ScopeSpans.spans
            groups.setdefault(resource, {}).setdefault(scope, []).append(length_delimited(b"\x12", span))
        self.sink.submit(export_request_bytes(groups))

    def start(self) -> PolicyForwarder:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Parse what is queued, then decide every trace still held by the ratio."""
        from .otlp_forward import stop_worker

        stop_worker(self._q, self._thread, timeout_s)
        self.expire(now=float("inf"))

    @property
    def held_bytes(self) -> int:
        return self._held_bytes


def decide(batch, rm, slos: dict, stalled: set[str], policy: TracePolicy) -> dict[bytes, bool]:
    """Per trace of a derived batch (trace id bytes): does a rule other than the ratio keep it?
    ``stalled``: the trace ids (hex) whose paired request stalled."""
    import numpy as np

    from otel_llm.metrics.summary import bound_checks

    keep = np.zeros(len(batch), bool)
    status = np.array(batch.status)
    if policy.error:
        keep |= status != RequestStatus.OK
    if policy.slo and slos:
        for slo in slos.values():
            for ok in bound_checks(rm, slo).values():
                keep |= (status == RequestStatus.OK) & ~ok
    out: dict[bytes, bool] = {}
    for tid, k in zip(batch.trace_id, keep.tolist()):
        b = bytes.fromhex(tid)
        out[b] = out.get(b, False) or k or (policy.stall and tid in stalled)
    return out
