"""Building OpenTelemetry spans from finished-request and step records, with explicit times.

Runs off the engine's thread. Span layout (docs/architecture.md): ``llm.request`` (SERVER) with children
``llm.queue``, ``llm.prefill``, ``llm.decode``, one ``llm.preemption`` per preemption and
``llm.stream``; the token-event arrays ride on ``llm.request``. Children are clamped inside
their parent for trace viewers, token events never: an ordering the recorded times break is said
on ``llm.request`` (``llm.timeline.violations``) and counted by the collector. Engine steps go
into one trace per export batch: an ``llm.engine.steps`` span with one ``llm.engine.step`` child
per iteration.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.status import Status, StatusCode

from otel_llm import semconv as sc
from otel_llm.environment import Detail
from otel_llm.otlp.sdk_internals import configured_sampler, sampler_shortcut, sampling_probability, shortcut_decision
from otel_llm.semconv import Boundary, RequestStatus

from .kv_fetch import KvFetchRecord, KvTransportRecord
from .tracker import FinishedRequest, PreemptionRecord, StepRecord

_SCOPE = InstrumentationScope("engine_hooks", "0.1.0")
_PROPAGATOR = TraceContextTextMapPropagator()
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET = Status(StatusCode.UNSET)  # immutable: one for every span without a status


def parent_from_headers(headers: Mapping[str, str] | None) -> SpanContext | None:
    """The remote parent span context of a W3C ``traceparent`` header, if valid."""
    if not headers:
        return None
    ctx = _PROPAGATOR.extract(carrier=dict(headers))
    sc_ = trace_api.get_current_span(ctx).get_span_context()
    return sc_ if sc_.is_valid else None


def _broken_orderings(r: FinishedRequest) -> list[str]:
    """The orderings of one request's timeline that its recorded times break (kinds of
    :data:`collector.pipeline.invariants.KINDS`): each must hold, and one that does not is said."""
    s0, s1 = r.start_ns, r.end_ns
    out = []
    t = r.out_times_ns  # in the order they were recorded, on a monotonic clock
    if len(t) and t[0] < s0:
        out.append("token_before_arrival")
    if len(t) and t[-1] > s1:
        out.append("token_after_finish")
    if r.queued_ns is not None and r.queued_ns < s0:
        out.append("queued_before_arrival")
    phases = [r.first_scheduled_ns, r.first_generated_ns, r.last_generated_ns]
    phases += [t for t0, t1, _ in r.preemptions for t in (t0, t1)]
    if any(t is not None and not s0 <= t <= s1 for t in phases):
        out.append("phase_outside_request")
    return out


class SpanFactory:
    def __init__(
        self,
        resource: Resource,
        boundary: str = Boundary.ENGINE,
        engine: str | None = None,
        model: str | None = None,
        detail: str = Detail.PHASES,
        sampler=None,
        int_arrays: bool = False,
    ):
        self.resource = resource
        # token-event arrays as int64 numpy arrays, for an exporter that takes them (otel_llm's own
        # encoders: otel_llm.otlp.export); lists (what any OpenTelemetry exporter takes) otherwise
        self.int_arrays = int_arrays
        self.detail = detail  # request: the llm.request span alone (OTEL_LLM_DETAIL)
        # which requests are traced: OTEL_TRACES_SAMPLER's sampler, decided as the SDK's tracer would
        # (a parent-based one follows the caller's traceparent); requests it drops are only counted
        self.sampler = sampler if sampler is not None else configured_sampler()
        self._shortcut = sampler_shortcut(self.sampler)  # the usual samplers, decided without a context
        self.unsampled = 0
        self.boundary = boundary
        self.engine = engine
        self.model = model
        self._ids = RandomIdGenerator()

    def _ctx(self, trace_id: int) -> SpanContext:
        return SpanContext(trace_id, self._ids.generate_span_id(), is_remote=False, trace_flags=_SAMPLED)

    def _span(
        self,
        name: str,
        ctx: SpanContext,
        parent: SpanContext | None,
        start: int,
        end: int,
        attrs: dict,
        kind: SpanKind = SpanKind.INTERNAL,
        status: Status | None = None,
    ) -> ReadableSpan:
        return ReadableSpan(
            name=name,
            context=ctx,
            parent=parent,
            resource=self.resource,
            attributes=attrs,
            kind=kind,
            status=status or _UNSET,
            start_time=start,
            end_time=max(end, start),
            instrumentation_scope=_SCOPE,
        )

    def _sampled(self, parent: SpanContext | None, trace_id: int, name: str) -> tuple[bool, float | None]:
        """(keep it, the probability it was kept with where this sampler decided)."""
        quick = shortcut_decision(self._shortcut, None if parent is None else parent.trace_flags.sampled)
        if quick is not None:  # the usual samplers, decided without a context
            if not quick[0]:
                self.unsampled += 1
            return quick
        ctx = trace_api.set_span_in_context(NonRecordingSpan(parent)) if parent is not None else None
        if not self.sampler.should_sample(ctx, trace_id, name, SpanKind.SERVER).decision.is_sampled():
            self.unsampled += 1
            return False, None
        return True, sampling_probability(self.sampler, parent is not None)

    def request_spans(self, r: FinishedRequest) -> list[ReadableSpan]:
        parent = parent_from_headers(r.trace_headers)
        trace_id = parent.trace_id if parent else self._ids.generate_trace_id()
        keep, p = self._sampled(parent, trace_id, sc.SPAN_REQUEST)
        if not keep:
            return []
        root = self._ctx(trace_id)
        attrs, status = self._request_attributes(r, p)
        out = [self._span(sc.SPAN_REQUEST, root, parent, r.start_ns, r.end_ns, attrs, SpanKind.SERVER, status)]
        if self.detail != Detail.REQUEST:
            self._phase_spans(r, trace_id, root, out)
        return out

    def _request_attributes(self, r: FinishedRequest, p: float | None) -> tuple[dict, Status | None]:
        """The ``llm.request`` span's attributes (``p``: the sampling probability it was kept with)
        and its status (None where ok)."""
        s0 = r.start_ns
        out_tokens = np.asarray(r.out_tokens, dtype=np.int64)
        broken = _broken_orderings(r)
        attrs = {
            sc.BOUNDARY: self.boundary,
            sc.REQUEST_ID: r.request_id,
            sc.STATUS: r.status,
            sc.OUTPUT_TOKENS: r.output_tokens,
            sc.PREEMPTIONS: len(r.preemptions),
            sc.TOKEN_EVENT_OFFSETS: self._offsets(r.out_times_ns, s0),
            sc.TOKEN_EVENT_TOKENS: self._array(out_tokens),
        }
        if broken:  # said, never clamped away: the collector counts them (collector.pipeline.invariants)
            attrs[sc.TIMELINE_VIOLATIONS] = ",".join(broken)
        if len(r.gen_times_ns):
            attrs[sc.TOKEN_GENERATED_OFFSETS] = self._offsets(r.gen_times_ns, s0)
            gen_tokens = np.asarray(r.gen_tokens, dtype=np.int64)
            # the tracker hands one array for both where each output is all a step generated
            if r.gen_tokens is not r.out_tokens and not np.array_equal(gen_tokens, out_tokens):
                attrs[sc.TOKEN_GENERATED_TOKENS] = self._array(gen_tokens)
        if r.input_tokens is not None:
            attrs[sc.INPUT_TOKENS] = r.input_tokens
        if self.model:
            attrs[sc.REQUEST_MODEL] = self.model
        if self.engine:
            attrs[sc.ENGINE_NAME] = self.engine
        if r.finish_reason:
            attrs[sc.FINISH_REASONS] = [r.finish_reason]
        if r.incomplete:
            attrs[sc.REQUEST_INCOMPLETE] = True
        if r.tokens_after_abort is not None:
            attrs[sc.TOKENS_AFTER_ABORT] = r.tokens_after_abort
        if p is not None and p < 1.0:
            attrs[sc.SAMPLING_PROBABILITY] = p
        if r.attrs:
            attrs.update(r.attrs)
        if r.status == RequestStatus.OK:
            return attrs, None
        failed = r.status in (RequestStatus.ERROR, RequestStatus.REJECTED) and r.finish_reason
        attrs[sc.ERROR_TYPE] = r.finish_reason if failed else r.status
        return attrs, Status(StatusCode.ERROR, r.status)

    def _phase_spans(self, r: FinishedRequest, trace_id: int, root, out: list[ReadableSpan]) -> None:
        """The request's phase spans (front end, queue, prefill, decode, preemptions, stream),
        children of its ``llm.request`` span ``root``, appended to ``out``."""
        s0, s1 = r.start_ns, r.end_ns
        clamp = lambda t: min(max(t, s0), s1)  # phase spans stay inside the request for trace viewers
        b = {sc.BOUNDARY: self.boundary}
        # a child without attributes of its own shares the boundary's (spans only read them)
        child = lambda name, t0, t1, a=None: out.append(
            self._span(name, self._ctx(trace_id), root, clamp(t0), clamp(t1), {**b, **a} if a else b)
        )
        sched = r.first_scheduled_ns
        queued = r.queued_ns
        if queued is not None and s0 <= queued <= (sched if sched is not None else s1):
            # the engine says when the request reached its scheduler: the front end's own time first
            child(sc.SPAN_FRONTEND, s0, queued)
        else:
            queued = s0  # an engine with no separate front end: its queue starts at arrival
        child(
            sc.SPAN_QUEUE,
            queued,
            sched if sched is not None else s1,
            None if sched is not None else {sc.QUEUE_INCOMPLETE: True},
        )
        if sched is not None and r.first_generated_ns is not None:
            child(sc.SPAN_PREFILL, sched, r.first_generated_ns)
            if r.last_generated_ns is not None and r.generated_tokens > 1:
                child(sc.SPAN_DECODE, r.first_generated_ns, r.last_generated_ns)
        for k, (t0, t1, mode) in enumerate(r.preemptions):
            a = {sc.PREEMPTION_MODE: mode}
            if k < len(r.preemption_tokens):
                a[sc.PREEMPTION_RECOMPUTE_TOKENS] = r.preemption_tokens[k]
            if k < len(r.preemption_kv) and r.preemption_kv[k] is not None:
                a[sc.PREEMPTION_KV_USAGE] = float(r.preemption_kv[k])
            child(sc.SPAN_PREEMPTION, t0, t1, a)
        if len(r.out_times_ns):
            t = r.out_times_ns
            child(sc.SPAN_STREAM, int(t[0]), int(t[-1]), {sc.STREAM_EVENTS: len(t)})

    def _array(self, values: np.ndarray):
        """An int64 array as the attribute value the exporter takes."""
        return values if self.int_arrays else values.tolist()

    def _offsets(self, times, s0: int):
        """Token-event times (wall ns) as offsets from the span's start, as they are: one outside
        the span is a broken ordering (:func:`_broken_orderings`), not clamped into it."""
        return self._array(np.asarray(times, dtype=np.int64) - s0)

    def http_span(self, h, wall_ns) -> ReadableSpan | None:
        """The server span of one HTTP request (:class:`engine_hooks.spans.tracker.HttpRecord`; ``wall_ns``
        turns its monotonic times into wall-clock ns)."""
        t0, t1 = wall_ns(h.start_mono), wall_ns(h.end_mono)
        ctx = SpanContext(
            int.from_bytes(h.trace_id, "big"),
            int.from_bytes(h.span_id, "big"),
            is_remote=False,
            trace_flags=TraceFlags(h.parent_flags & 1 or 1),
        )
        parent = None
        if h.parent_span_id:
            parent = SpanContext(
                int.from_bytes(h.trace_id, "big"),
                int.from_bytes(h.parent_span_id, "big"),
                is_remote=True,
                trace_flags=TraceFlags(h.parent_flags & 1),
            )
        if not h.sampled:  # the middleware decided, and told the engine in the traceparent it handed on
            self.unsampled += 1
            return None
        attrs = {
            sc.BOUNDARY: Boundary.SERVER,
            sc.HTTP_METHOD: h.method,
            sc.URL_PATH: h.path,
            # offsets on one clock: the record's monotonic times less its start
            sc.HTTP_CHUNK_OFFSETS: self._array(np.asarray(h.chunk_mono, dtype=np.int64) - h.start_mono),
        }
        if h.status is not None:
            attrs[sc.HTTP_STATUS] = int(h.status)
        if h.response_start_mono is not None:
            attrs[sc.HTTP_RESPONSE_START] = wall_ns(h.response_start_mono) - t0
        attrs[sc.HTTP_APP_START] = h.app_start_mono - h.start_mono
        if h.probability is not None and h.probability < 1.0:
            attrs[sc.SAMPLING_PROBABILITY] = h.probability
        status = Status(StatusCode.ERROR) if h.status is not None and h.status >= 500 else None
        return self._span(f"{h.method} {h.path}", ctx, parent, t0, t1, attrs, SpanKind.SERVER, status)

    def preemption_spans(self, preemptions: list[PreemptionRecord]) -> list[ReadableSpan]:
        """One ``llm.engine.preemption`` span (a trace of its own, at the moment it happened) per
        preemption of a request traced in another process."""
        out = []
        for p in preemptions:
            a = {sc.BOUNDARY: self.boundary, sc.REQUEST_INTERNAL_ID: p.request_id, sc.PREEMPTION_MODE: p.mode}
            if self.engine:
                a[sc.ENGINE_NAME] = self.engine
            if p.kv_usage is not None:
                a[sc.PREEMPTION_KV_USAGE] = float(p.kv_usage)
            if p.recompute_tokens is not None:
                a[sc.PREEMPTION_RECOMPUTE_TOKENS] = int(p.recompute_tokens)
            ctx = self._ctx(self._ids.generate_trace_id())
            out.append(self._span(sc.SPAN_ENGINE_PREEMPTION, ctx, None, p.time_ns, p.time_ns, a))
        return out

    def speculation_spans(self, records) -> list[ReadableSpan]:
        """One ``llm.engine.speculation`` span (a trace of its own, over the request's steps) per
        :class:`~engine_hooks.spans.speculation.SpeculationRecord` of a request traced in another
        process; its event arrays line up with that request's token events."""
        out = []
        for r in records:
            a = {
                sc.BOUNDARY: self.boundary,
                sc.REQUEST_INTERNAL_ID: r.request_id,
                sc.SPECULATION_DRAFT_TOKENS: r.draft_tokens,
                sc.SPECULATION_ACCEPTED_TOKENS: r.accepted_tokens,
                sc.SPECULATION_VERIFY_STEPS: r.verify_steps,
                sc.SPECULATION_EVENT_TOKENS: self._array(np.asarray(r.tokens, dtype=np.int64)),
                sc.SPECULATION_EVENT_DRAFTS: self._array(np.asarray(r.drafts, dtype=np.int64)),
                sc.SPECULATION_EVENT_ACCEPTED: self._array(np.asarray(r.accepted, dtype=np.int64)),
            }
            if self.engine:
                a[sc.ENGINE_NAME] = self.engine
            if r.method:
                a[sc.SPECULATION_METHOD] = str(r.method)
            if r.num_speculative_tokens is not None:
                a[sc.SPECULATION_K] = int(r.num_speculative_tokens)
            if r.incomplete:
                a[sc.SPECULATION_INCOMPLETE] = True
            ctx = self._ctx(self._ids.generate_trace_id())
            out.append(self._span(sc.SPAN_ENGINE_SPECULATION, ctx, None, r.start_ns, r.end_ns, a))
        return out

    def kv_spans(self, records) -> list[ReadableSpan]:
        """One span (a trace of its own) per KV connector account of a request traced in another
        process: a :class:`~engine_hooks.spans.kv_fetch.KvFetchRecord` as ``llm.engine.kv_transfer``
        (the scheduler took it -> it left the fetch, with when the load started and when the
        transfer was seen complete), a ``KvHoldRecord`` as ``llm.engine.kv_hold`` (the request
        finished -> its blocks freed), a ``KvTransportRecord`` as ``llm.engine.kv_transport`` (the
        bytes and the transport's time)."""
        out = []
        for r in records:
            a = {sc.BOUNDARY: self.boundary, sc.REQUEST_INTERNAL_ID: r.request_id}
            if self.engine:
                a[sc.ENGINE_NAME] = self.engine
            if isinstance(r, KvFetchRecord):
                name = sc.SPAN_ENGINE_KV_TRANSFER
                if r.load_ns is not None:
                    a[sc.KV_LOAD_OFFSET] = r.load_ns - r.start_ns
                if r.received_ns is not None:
                    a[sc.KV_RECEIVED_OFFSET] = r.received_ns - r.start_ns
                if r.failed_ns is not None:
                    a[sc.KV_FAILED_OFFSET] = r.failed_ns - r.start_ns
            elif isinstance(r, KvTransportRecord):
                name = sc.SPAN_ENGINE_KV_TRANSPORT
                a[sc.KV_BYTES], a[sc.KV_WIRE] = int(r.nbytes), int(r.wire_ns)
                if r.handshake_ns is not None:
                    a[sc.KV_HANDSHAKE] = int(r.handshake_ns)
            else:
                name = sc.SPAN_ENGINE_KV_HOLD
            if getattr(r, "blocks", None) is not None:
                a[sc.KV_BLOCKS] = int(r.blocks)
            if r.incomplete:
                a[sc.KV_INCOMPLETE] = True
            ctx = self._ctx(self._ids.generate_trace_id())
            out.append(self._span(name, ctx, None, r.start_ns, r.end_ns, a))
        return out

    def step_spans(self, steps: list[StepRecord]) -> list[ReadableSpan]:
        if not steps:
            return []
        trace_id = self._ids.generate_trace_id()
        root = self._ctx(trace_id)
        b = {sc.BOUNDARY: self.boundary}
        if self.engine:
            b[sc.ENGINE_NAME] = self.engine
        out = [
            self._span(
                sc.SPAN_STEPS,
                root,
                None,
                steps[0].start_ns,
                max(s.end_ns for s in steps),
                {**b, sc.STEPS_COUNT: len(steps), sc.STEPS_FIRST_INDEX: steps[0].index},
            )
        ]
        for s in steps:
            a = {
                **b,
                sc.STEP_INDEX: s.index,
                sc.STEP_BATCH_SIZE: s.batch_size,
                sc.STEP_PREFILL_TOKENS: s.prefill_tokens,
                sc.STEP_DECODE_TOKENS: s.decode_tokens,
                sc.STEP_PREEMPTED: s.preempted,
            }
            if s.kv_usage is not None:
                a[sc.STEP_KV_USAGE] = float(s.kv_usage)
            if s.gpu_time_ns is not None:
                a[sc.STEP_GPU_TIME_NS] = int(s.gpu_time_ns)
            if s.waiting is not None:
                a[sc.STEP_WAITING] = int(s.waiting)
                if s.wait_reason:
                    a[sc.STEP_WAIT_REASON] = str(s.wait_reason)
            if s.draft_tokens is not None:
                a[sc.STEP_DRAFT_TOKENS] = int(s.draft_tokens)
                a[sc.STEP_ACCEPTED_TOKENS] = int(s.accepted_tokens)
            out.append(self._span(sc.SPAN_STEP, self._ctx(trace_id), root, s.start_ns, s.end_ns, a))
        return out
