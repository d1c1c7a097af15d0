"""The fast OTLP encoders give what the SDK's give, and the exporters built from the
environment deliver it."""

import enum
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from otel_llm import accelerator
from otel_llm.otlp import otlp_encode
from otel_llm.otlp.export import exporter_from_env
from otel_llm.otlp.otlp_json import from_dict

i64 = st.integers(-(2**63), 2**63 - 1)
values = st.one_of(
    st.text(max_size=10),
    st.booleans(),
    i64,
    st.floats(allow_nan=False),
    st.lists(i64, max_size=40),
    st.lists(st.text(max_size=5), max_size=4),
    st.lists(st.booleans(), max_size=3),
    st.lists(st.floats(allow_nan=False), max_size=3),
)
attrs = st.dictionaries(st.text(min_size=1, max_size=12), values, max_size=6)


def make_span(a, kind, parent, status, name="s", res=None):
    ctx = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, False, TraceFlags(1))
    par = (
        SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0x1111111111111111, parent == "remote", TraceFlags(1))
        if parent
        else None
    )
    return ReadableSpan(
        name=name,
        context=ctx,
        parent=par,
        resource=res or Resource.create({"service.name": "t"}),
        attributes=a,
        kind=kind,
        status=status,
        start_time=1_700_000_000_000_000_000,
        end_time=1_700_000_000_500_000_000,
        instrumentation_scope=InstrumentationScope("sc", "1"),
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(attrs, min_size=1, max_size=4),
    st.sampled_from(list(SpanKind)),
    st.sampled_from([None, "local", "remote"]),
    st.sampled_from([Status(StatusCode.UNSET), Status(StatusCode.OK), Status(StatusCode.ERROR, "boom")]),
)
def test_fast_encoding_equals_the_sdk(attr_sets, kind, parent, status):
    res = Resource.create({"service.name": "t"})
    spans = [make_span(a, kind, parent, status, f"s{i}", res) for i, a in enumerate(attr_sets)]
    fast = otlp_encode.encode_spans(spans)
    assert fast == sdk_encode(spans)
    assert from_dict(json.loads(otlp_encode.spans_to_json(spans))) == sdk_encode(spans)


def test_int_arrays_wire_format_edges():
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue

    boundaries = [v for k in range(1, 10) for v in (2 ** (7 * k) - 1, 2 ** (7 * k)) if v < 2**63]  # each varint length
    cases = [[], [0], [1, 127, 128, 16383, 16384], [-1, -(2**63), 2**63 - 1], list(range(0, 10**12, 10**9))]
    cases += [boundaries, [], [3] * 5, [-(v) for v in boundaries]]
    got = otlp_encode.int_arrays_bytes(cases)
    for vals, blob in zip(cases, got):
        assert blob == ArrayValue(values=[AnyValue(int_value=v) for v in vals]).SerializeToString()


def test_a_json_string_that_looks_like_a_placeholder_stays_a_string():
    s = make_span({"a": "\x00otel-llm-raw-1-0", "b": [1, 2, 3]}, SpanKind.INTERNAL, None, Status(StatusCode.UNSET))
    d = json.loads(otlp_encode.spans_to_json([s]))
    kvs = {kv["key"]: kv["value"] for kv in d["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]}
    assert kvs["a"] == {"stringValue": "\x00otel-llm-raw-1-0"}
    assert kvs["b"]["arrayValue"]["values"][2] == {"intValue": "3"}


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_exporters_from_the_environment_deliver_token_arrays(make_collector, monkeypatch, protocol):
    c = make_collector()
    port = c.receivers[0].port if protocol == "grpc" else c.receivers[1].address[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.delenv("OTEL_LLM_TRACES_FILE", raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    exporter = exporter_from_env()
    now = time.time_ns()
    offs = [10_000_000 + 3_000_000 * j for j in range(200)]
    span = ReadableSpan(
        name="llm.request",
        context=SpanContext(0xABC, 0xDEF, False, TraceFlags(1)),
        resource=Resource.create({"service.name": "e"}),
        kind=SpanKind.SERVER,
        attributes={
            "llm.boundary": "engine",
            "llm.request.id": "x",
            "llm.request.status": "ok",
            "llm.token_event.offsets_ns": offs,
            "llm.token_event.tokens": [1] * 200,
        },
        start_time=now,
        end_time=now + 700_000_000,
    )
    assert exporter.export([span]).name == "SUCCESS"
    t0 = time.monotonic()
    while c.store.count() < 1 and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    (rec,) = c.store.records()
    assert list(rec.event_offsets_ns) == offs and rec.output_tokens == 200
    exporter.shutdown()


class _Level(enum.IntEnum):
    HIGH = 3


class _Mode(str, enum.Enum):
    RECOMPUTE = "recompute"


class _Ratio(float):
    pass


@pytest.mark.parametrize(
    "attrs",
    [{"level": _Level.HIGH}, {"mode": _Mode.RECOMPUTE}, {"ratio": _Ratio(0.5)}, {"modes": [_Mode.RECOMPUTE]}],
    ids=["IntEnum", "str Enum", "float subclass", "list of str Enum"],
)
def test_subclass_values_encode_as_the_sdk_takes_them(attrs):
    """Each alone (a span the fast encoder cannot take goes whole to the SDK, which would hide a
    wrong one beside it): the SDK encodes a subclass by the plain type it subclasses, a str
    Enum's value (not its str(), which is its name); so must the fast encoder."""
    s = make_span(attrs, SpanKind.INTERNAL, None, Status(StatusCode.UNSET))
    assert otlp_encode.encode_spans([s]) == sdk_encode([s])
    assert from_dict(json.loads(otlp_encode.spans_to_json([s]))) == sdk_encode([s])


def test_spans_of_interleaved_resources_and_scopes_group_as_the_sdk_groups_them():
    """The encoder keeps the last (resource, scope) group at hand for the next span: spans that
    switch between resources and scopes (a None scope among them) still land in their own groups,
    in the order the SDK gives them."""
    a, b = Resource.create({"service.name": "a"}), Resource.create({"service.name": "b"})
    one, two = InstrumentationScope("one", "1"), InstrumentationScope("two")
    layout = [(a, one), (b, one), (a, one), (a, two), (b, None), (a, one), (b, None), (a, two)]
    spans = []
    for i, (res, scope) in enumerate(layout):
        s = make_span(
            {"i": i, "offs": list(range(i + 1))}, SpanKind.CLIENT, "remote", Status(StatusCode.OK), f"s{i}", res
        )
        s._instrumentation_scope = scope
        spans.append(s)
    assert otlp_encode.encode_spans(spans) == sdk_encode(spans)
    assert from_dict(json.loads(otlp_encode.spans_to_json(spans))) == sdk_encode(spans)


@pytest.mark.skipif(not accelerator.on(otlp_encode._int_text), reason="the C accelerator is not built here (or is off)")
def test_the_c_writer_of_integer_arrays_writes_what_python_writes(monkeypatch):
    """Token-event offsets go through the C writer (otel_llm/otlp/_int_text.c) where it is built:
    the text must be the Python writer's to the byte, at int64's edges and for every array kind
    the span factory hands over (numpy int64, lists of ints, a non-contiguous view)."""
    import numpy as np

    edges = [0, 1, -1, 9, 10, 99, 100, 2**31, -(2**31), 2**63 - 1, -(2**63), 10**18, -(10**18) + 7]
    base = np.arange(-5, 300, dtype=np.int64) * 1_234_567
    values = [edges, list(range(1000)), base, base[::3], np.array(edges, dtype=np.int64), [2**63, 1], [True, 2]]
    s = make_span({f"a{i}": v for i, v in enumerate(values)}, SpanKind.SERVER, "local", Status(StatusCode.UNSET))
    fast = otlp_encode.spans_to_json([s])
    monkeypatch.setenv("OTEL_LLM_PURE_PYTHON", "1")  # the Python writer
    assert fast == otlp_encode.spans_to_json([s])
    kvs = {
        kv["key"]: kv["value"] for kv in json.loads(fast)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]
    }
    assert [int(v["intValue"]) for v in kvs["a0"]["arrayValue"]["values"]] == edges
    assert [int(v["intValue"]) for v in kvs["a3"]["arrayValue"]["values"]] == base[::3].tolist()
    with pytest.raises(TypeError):
        from otel_llm.otlp._int_text import values_json

        values_json(np.zeros(3, dtype=np.int32))  # only int64 buffers


def test_a_span_that_falls_back_to_the_sdk_keeps_its_numpy_token_arrays():
    """engine_hooks hands the token-event arrays over as int64 numpy arrays; an attribute the fast
    encoder leaves to the SDK (a numpy scalar an extractor returned) sent the whole span to the
    SDK's encoder, which dropped the arrays with it: the request's TTFT and ITL were unknown.
    Now the arrays go as the lists the SDK takes; the numpy scalar is what the SDK makes of it."""
    import numpy as np
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    offsets = np.array([1_000, 2_500, 4_000], dtype=np.int64)
    s = make_span(
        {"llm.token_event.offsets_ns": offsets, "llm.test.np": np.int64(7), "llm.request.id": "r1"},
        SpanKind.INTERNAL,
        None,
        Status(StatusCode.UNSET),
    )
    req = ExportTraceServiceRequest.FromString(otlp_encode.encode_spans_bytes([s]))
    (span,) = req.resource_spans[0].scope_spans[0].spans
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert [v.int_value for v in attrs["llm.token_event.offsets_ns"].array_value.values] == offsets.tolist()
    assert attrs["llm.request.id"].string_value == "r1"
    plain = make_span(
        {"llm.token_event.offsets_ns": offsets.tolist(), "llm.test.np": np.int64(7), "llm.request.id": "r1"},
        SpanKind.INTERNAL,
        None,
        Status(StatusCode.UNSET),
    )
    assert req == sdk_encode([plain])  # what the SDK makes of the same span with list arrays
