"""The OpenTelemetry SDK internals otel_llm relies on (otel_llm/otlp/sdk_internals.py), each checked by
name: when an SDK release changes one, this file fails and says which, before anything exports
slowly or wrongly. pyproject.toml bounds the SDK to the versions this passed on."""

import inspect
from importlib.metadata import version

import pytest
from opentelemetry.sdk.resources import Resource

from otel_llm.otlp import otlp_encode, sdk_internals

SDK = f"opentelemetry-sdk {version('opentelemetry-sdk')}, exporters {version('opentelemetry-exporter-otlp-proto-grpc')}"


def test_encode_attributes_is_the_sdks_resource_encoding():
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from support.tests_support_spans import one_span

    res = Resource.create({"service.name": "x", "n": 3, "ok": True, "ids": [1, 2]})
    span = one_span(res)
    want = list(encode_spans([span]).resource_spans[0].resource.attributes)
    assert sdk_internals.encode_attributes(res.attributes) == want, f"_encode_attributes changed in {SDK}"


def test_a_readable_spans_stored_fields_are_what_its_properties_give():
    """span_fields reads a ReadableSpan's fields as stored (``_name``, ``_context``, ...), one C
    call where the properties are a dozen Python calls: each must still be what its property
    gives, and the SDK's live span (another type) goes through the properties."""
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Link, SpanKind
    from opentelemetry.trace.status import Status, StatusCode
    from support.tests_support_spans import one_span

    span = one_span(Resource.create({"service.name": "x"}))
    stored = sdk_internals.span_fields(span)
    for name, got in zip(sdk_internals.SPAN_FIELDS, stored, strict=True):
        want = getattr(span, name)
        if name == "attributes":
            assert dict(got) == dict(want), f"ReadableSpan._attributes changed in {SDK}"
        elif name in ("events", "links"):
            assert tuple(got) == tuple(want), f"ReadableSpan._{name} changed in {SDK}"
        else:
            assert got is want, f"ReadableSpan._{name} changed in {SDK}"
    assert type(span) is ReadableSpan
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    with provider.get_tracer("t").start_as_current_span(
        "live", kind=SpanKind.CLIENT, links=[Link(span.context)]
    ) as live:
        live.set_status(Status(StatusCode.ERROR, "x"))
    (done,) = memory.get_finished_spans()
    fields = sdk_internals.span_fields(done)
    assert fields[0] == "live" and fields[3] is SpanKind.CLIENT and len(fields[9]) == 1 and fields[7].description == "x"
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    assert otlp_encode.encode_spans([done, span]) == encode_spans([done, span])  # both kinds, one batch


def test_the_grpc_exporter_still_translates_through_translate_data():
    from opentelemetry.exporter.otlp.proto.grpc.exporter import OTLPExporterMixin
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

    assert callable(getattr(OTLPSpanExporter, "_translate_data", None)), f"no _translate_data in {SDK}"
    export_path = inspect.getsource(OTLPExporterMixin._export)
    assert "self._client.Export(" in export_path and "request=self._translate_data(data)" in export_path, (
        f"the gRPC export path changed in {SDK}"
    )
    assert "self._client = self._stub(self._channel)" in inspect.getsource(
        OTLPExporterMixin._initialize_channel_and_stub
    ), f"the gRPC exporter builds its stub elsewhere in {SDK}"
    # the SDK's stub calls the method our bytes stub calls
    assert sdk_internals.TRACE_EXPORT_METHOD in inspect.getsource(TraceServiceStub.__init__)
    seen = []
    exp = sdk_internals.grpc_span_exporter(lambda spans: seen.append(spans) or b"wire")
    assert exp._translate_data([]) == b"wire" and seen == [[]]
    assert isinstance(exp._client, sdk_internals._WireTraceStub)
    exp._initialize_channel_and_stub()  # what the SDK does to reconnect after some errors
    assert isinstance(exp._client, sdk_internals._WireTraceStub)
    exp.shutdown()


def test_the_http_exporter_still_encodes_through_its_module_function():
    import opentelemetry.exporter.otlp.proto.http.trace_exporter as sdk_http

    assert callable(getattr(sdk_http, "encode_spans", None)), f"no module-level encode_spans in {SDK}"
    assert "encode_spans(spans)" in inspect.getsource(sdk_http.OTLPSpanExporter.export), (
        f"the HTTP exporter's export() no longer calls encode_spans(spans) in {SDK}"
    )


def test_the_http_shim_passes_our_encoding_and_leaves_everyone_elses():
    import opentelemetry.exporter.otlp.proto.http.trace_exporter as sdk_http
    from support.tests_support_spans import one_span

    calls = []

    def ours(spans):
        calls.append(len(spans))
        return otlp_encode.encode_spans_bytes(spans)

    exp = sdk_internals.http_span_exporter(ours, endpoint="http://127.0.0.1:9/v1/traces", timeout=1)
    span = one_span(Resource.create({"service.name": "x"}))
    # someone else's HTTP exporter (not ours) still gets the SDK's own encoding through the shim
    plain = sdk_http.encode_spans([span])
    assert plain == sdk_internals.sdk_encode_spans([span]) and calls == []
    batch = sdk_internals._Encoded([span])
    batch.request = sdk_internals._Serialized(ours([span]))
    assert sdk_http.encode_spans(batch) is batch.request
    # what the exporter sends: the serialized request, the SDK's message to the byte
    assert batch.request.SerializePartialToString() == sdk_internals.sdk_encode_spans([span]).SerializeToString()
    exp.shutdown()


@pytest.mark.parametrize("pkg", ["opentelemetry-sdk", "opentelemetry-api", "opentelemetry-exporter-otlp-proto-http"])
def test_the_installed_sdk_is_inside_the_declared_range(pkg):
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    reqs = {Requirement(r).name: Requirement(r) for r in requires("otel-llm") if "extra ==" not in r}
    assert reqs[pkg].specifier.contains(version(pkg)), f"{pkg} {version(pkg)} is outside {reqs[pkg].specifier}"
    assert any(s.operator == "<" for s in reqs[pkg].specifier), f"{pkg} has no upper bound"


@pytest.mark.parametrize(
    "name, arg, root_p, child_p",
    [
        ("traceidratio", "0.25", 0.25, 0.25),
        ("parentbased_traceidratio", "0.1", 0.1, None),
        ("always_on", None, 1.0, 1.0),
        ("parentbased_always_on", None, 1.0, None),
        ("always_off", None, None, None),
    ],
)
def test_the_sampler_the_environment_configures_and_its_probability(monkeypatch, name, arg, root_p, child_p):
    """What OTEL_TRACES_SAMPLER(_ARG) build is what the SDK's TracerProvider builds, and its
    probability is read from the SDK's own sampler classes (ParentBased keeps its root in _root)."""
    from opentelemetry.sdk.trace import TracerProvider

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", name)
    if arg is None:
        monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG", raising=False)
    else:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
    s = sdk_internals.configured_sampler()
    assert s.get_description() == TracerProvider().sampler.get_description()
    assert sdk_internals.sampling_probability(s, has_parent=False) == root_p
    assert sdk_internals.sampling_probability(s, has_parent=True) == child_p
