"""Every use of the OpenTelemetry SDK's internals, in one module.

The OTLP exporters encode each attribute value as one protobuf message built in Python, which
costs a request span with two 256-entry token arrays about 0.7 ms; :mod:`otel_llm.otlp.otlp_encode`
does it in one vectorised pass. Plugging that encoder into the SDK's own exporters (so that their
configuration, retries and compression stay the SDK's) takes these, which the SDK does not promise:

* ``opentelemetry.exporter.otlp.proto.common._internal._encode_attributes`` (resource and scope
  attributes, encoded exactly as the SDK does);
* the gRPC span exporter's ``_translate_data(spans)`` hook (the request it sends; ours gives its
  serialized bytes), and its ``_client`` (the stub it calls ``Export`` on), built on its ``_channel`` by
  ``_initialize_channel_and_stub``: ours sends the request's bytes as they are, where the SDK's
  stub would serialize a message again;
* the HTTP span exporter's module-level ``encode_spans``, which its ``export`` calls by name (and
  serializes what it returns with ``SerializePartialToString``);
* ``ReadableSpan``'s fields behind its properties (``_name``, ``_context``, ...): each property is
  a Python call (``attributes`` a new mappingproxy), a dozen a span, about a quarter of encoding
  a small span; :func:`span_fields` reads them in one C call for the SDK's own ``ReadableSpan``
  (what engine_hooks builds), through the properties for any other span.

``pyproject.toml`` bounds the OpenTelemetry packages above, just past the newest release these
were checked on (1.45), and ``tests/unit/test_sdk_internals.py`` checks each assumption by name,
so an SDK that changes under them fails there, loudly, rather than exporting slowly or wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter

#: what span_fields gives, in order
SPAN_FIELDS = (
    "name",
    "context",
    "parent",
    "kind",
    "start_time",
    "end_time",
    "attributes",
    "status",
    "events",
    "links",
    "resource",
    "instrumentation_scope",
)
_public_fields = attrgetter(*SPAN_FIELDS)
_private_fields = attrgetter(*(f"_{f}" for f in SPAN_FIELDS))


def span_fields(span) -> tuple:
    """A finished span's :data:`SPAN_FIELDS` as a tuple (``attributes`` may be None or any
    mapping, ``events`` and ``links`` any sequence). For the SDK's own ``ReadableSpan`` its fields
    as they are stored; for any other span (the SDK's live ``Span``, another SDK's), its
    properties."""
    return _private_fields(span) if type(span) is ReadableSpan else _public_fields(span)


def dropped_attributes(attributes) -> int:
    """How many attributes a span's attribute mapping dropped (the SDK's ``BoundedAttributes``
    counts them; a plain dict drops none)."""
    return 0 if type(attributes) is dict or attributes is None else getattr(attributes, "dropped", 0)


def encode_attributes(attributes) -> list:
    """The SDK's own encoding of an attribute mapping (a list of ``KeyValue``)."""
    from opentelemetry.exporter.otlp.proto.common._internal import _encode_attributes

    return _encode_attributes(attributes) or []


def sdk_encode_spans(spans: Sequence):
    """The SDK's (public) span encoder: the reference, and the fallback for what ours leaves out."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return encode_spans(spans)


#: OTLP's gRPC method for traces (opentelemetry/proto/collector/trace/v1/trace_service.proto)
TRACE_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class _WireTraceStub:
    """The trace service's stub with no request serializer: ``Export`` takes the serialized
    ``ExportTraceServiceRequest`` and sends it as it is."""

    def __init__(self, channel):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        self.Export = channel.unary_unary(
            TRACE_EXPORT_METHOD, request_serializer=None, response_deserializer=ExportTraceServiceResponse.FromString
        )


def grpc_span_exporter(encode: Callable[[Sequence], bytes], **kwargs) -> SpanExporter:
    """The SDK's OTLP/gRPC span exporter (its channel, retries, compression and metrics), sending
    ``encode(spans)``: the serialized ``ExportTraceServiceRequest``."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    class FastOTLPSpanExporter(OTLPSpanExporter):
        def _initialize_channel_and_stub(self):  # at the start, and again to reconnect
            super()._initialize_channel_and_stub()
            self._client = _WireTraceStub(self._channel)

        def _translate_data(self, data):
            return encode(data)

    return FastOTLPSpanExporter(**kwargs)


class _Serialized:
    """A request already serialized, where the SDK's HTTP exporter expects a message to serialize."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def SerializePartialToString(self) -> bytes:
        return self.data

    SerializeToString = SerializePartialToString


class _Encoded(list):
    """Spans that carry their request already encoded (see :func:`http_span_exporter`)."""

    request: _Serialized | None = None


_SHIM = "__otel_llm_shim__"


def _install_http_shim(module) -> None:
    """Let the SDK's HTTP exporter take a pre-encoded batch: its module-level ``encode_spans`` is
    wrapped once so that an :class:`_Encoded` batch passes through; any other caller gets the
    SDK's own encoding, unchanged."""
    original = module.encode_spans
    if getattr(original, _SHIM, False):
        return

    def encode_spans(spans):
        return spans.request if isinstance(spans, _Encoded) else original(spans)

    setattr(encode_spans, _SHIM, True)
    module.encode_spans = encode_spans


def http_span_exporter(encode: Callable[[Sequence], bytes], **kwargs) -> SpanExporter:
    """The SDK's OTLP/HTTP (protobuf) span exporter (its session, retries, compression), sending
    ``encode(spans)``: the serialized ``ExportTraceServiceRequest``."""
    import opentelemetry.exporter.otlp.proto.http.trace_exporter as sdk_http

    _install_http_shim(sdk_http)

    class FastHTTPSpanExporter(sdk_http.OTLPSpanExporter):
        def export(self, spans):
            batch = _Encoded(spans)
            batch.request = _Serialized(encode(spans))
            return super().export(batch)

    return FastHTTPSpanExporter(**kwargs)


def configured_sampler():
    """The sampler ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` configure, as the SDK's own
    ``TracerProvider()`` would build it (default ``parentbased_always_on``; a bad value: the SDK's
    default, logged by the SDK)."""
    from opentelemetry.sdk.trace import sampling

    return sampling._get_from_env_or_default()


def sampling_probability(sampler, has_parent: bool) -> float | None:
    """The probability with which ``sampler`` keeps a span it decides itself: a ratio sampler's
    rate, 1 for always-on; for a parent-based sampler, its root sampler's when the span has no
    parent, and None (not this sampler's decision) when it has one. None for samplers whose
    probability is not known (custom ones, always-off)."""
    from opentelemetry.sdk.trace import sampling as s

    if isinstance(sampler, s.ParentBased):
        return None if has_parent else sampling_probability(sampler._root, False)
    if isinstance(sampler, s.TraceIdRatioBased):
        return float(sampler.rate)
    if isinstance(sampler, s.StaticSampler):
        return 1.0 if sampler._decision is s.Decision.RECORD_AND_SAMPLE else None
    return None


def sampler_shortcut(sampler) -> str | None:
    """What ``sampler`` decides, where it is one of the two everyone runs, so that a hot path can
    decide without building a context for it: ``"parent"`` for the SDK's default
    (``parentbased_always_on``: a caller's sampled flag, else keep), ``"always"`` for
    ``always_on``; None for any other (ask the sampler)."""
    from opentelemetry.sdk.trace import sampling as s

    if sampler is s.ALWAYS_ON:
        return "always"
    if (
        type(sampler) is s.ParentBased
        and sampler._root is s.ALWAYS_ON
        and sampler._remote_parent_sampled is s.ALWAYS_ON
        and sampler._remote_parent_not_sampled is s.ALWAYS_OFF
    ):
        return "parent"
    return None


def shortcut_decision(shortcut: str | None, parent_sampled: bool | None) -> tuple[bool, float | None] | None:
    """What a :func:`sampler_shortcut` sampler decides for a span whose parent's sampled flag is
    ``parent_sampled`` (None: no parent): (keep it, the probability where the sampler decided
    itself); None where the sampler must be asked."""
    if shortcut == "always":
        return True, 1.0
    if shortcut == "parent":
        return (True, 1.0) if parent_sampled is None else (parent_sampled, None)
    return None


def tracer_probability(tracer) -> float | None:
    """:func:`sampling_probability` of an SDK tracer's sampler for a span started now (a child of
    the current span, if there is one); None for tracers that are not the SDK's."""
    from opentelemetry import trace as trace_api

    sampler = getattr(tracer, "sampler", None)
    if sampler is None:
        return None
    return sampling_probability(sampler, trace_api.get_current_span().get_span_context().is_valid)
