"""The pipeline's last stage: records -> spans -> exporter.

:class:`SpanBuilder` builds the spans of one round's records (finished requests, engine steps,
preemptions and speculative decoding of requests traced elsewhere, HTTP requests) with the
:class:`SpanFactory` and hands them to the exporter in batches: on the pipeline's thread, or in the span process
(:mod:`engine_hooks.span_process.parent`), whose pipeline is fed the engine process's events.
"""

from __future__ import annotations

from otel_llm.environment import Detail

from .span_factory import SpanFactory


class SpanBuilder:
    """Builds one round's spans and exports them in batches of ``batch_size``; counts what the
    exporter took and what it failed to send."""

    def __init__(self, factory: SpanFactory, exporter, batch_size: int):
        self.factory = factory
        self.exporter = exporter  # a SafeSpanExporter, or None (export off)
        self.batch_size = batch_size

    def build(self, finished, steps, preemptions, http, wall_ns, speculations=(), kv_accounts=()) -> int:
        """Build and export; returns the number of spans handed to the exporter. ``wall_ns`` turns
        the HTTP records' monotonic times into wall-clock ns; ``speculations`` and ``kv_accounts``:
        the speculative decoding and the KV connector's accounts of requests traced elsewhere
        (:class:`~engine_hooks.spans.speculation.SpeculationRecord`;
        :class:`~engine_hooks.spans.kv_fetch.KvFetchRecord`, ``KvHoldRecord``)."""
        f = self.factory
        spans = []
        for r in finished:
            spans.extend(f.request_spans(r))
        if f.detail == Detail.STEPS:
            spans.extend(f.step_spans(steps))
        if f.detail != Detail.REQUEST:
            spans.extend(f.preemption_spans(preemptions))
            spans.extend(f.speculation_spans(speculations))
            spans.extend(f.kv_spans(kv_accounts))
        for h in http:
            span = f.http_span(h, wall_ns)
            if span is not None:
                spans.append(span)
        if self.exporter is None:
            return 0
        for i in range(0, len(spans), self.batch_size):
            self.exporter.export(spans[i : i + self.batch_size])
        return len(spans)
