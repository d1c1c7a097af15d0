"""One finished SDK span, built by hand (resource and attributes given), for encoder tests."""

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags


def one_span(resource, attributes=None) -> ReadableSpan:
    ctx = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, False, TraceFlags(1))
    return ReadableSpan(
        name="s",
        context=ctx,
        kind=SpanKind.INTERNAL,
        attributes=attributes or {"llm.token_event.offsets_ns": [1, 2, 3]},
        start_time=1,
        end_time=2,
        resource=resource,
        instrumentation_scope=InstrumentationScope("t", "1"),
    )
