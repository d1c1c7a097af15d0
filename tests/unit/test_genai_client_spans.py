"""A GenAI client instrumentation's span as the client boundary (collector/pipeline/genai_client_spans.py):
emitted through the OpenTelemetry SDK the way an instrumentation of the openai SDK emits it (name
"chat <model>", kind CLIENT, the GenAI attributes, the W3C context carried to the engine), and shaped
by hand at the wire level where its attributes are wrong; through both walkers, assembly and
derivation."""

from __future__ import annotations

import math

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from support.otlp_helpers import body, provider, records, span

from collector.pipeline.assembly import AssemblyConfig, TraceAssembler
from collector.pipeline.derive import derive
from collector.receivers.decode import decode_payload
from otel_llm import semconv as sc

T0 = 1_750_000_000_000_000_000
MS = 1_000_000


def genai_attrs(ttfc=0.06, output=9, rid="chatcmpl-1", operation="chat", stream=True) -> dict:
    """What a GenAI client instrumentation puts on its span (None leaves one out)."""
    a = {
        sc.OPERATION_NAME: operation,
        "gen_ai.provider.name": "openai",
        sc.REQUEST_MODEL: "tiny",
        sc.REQUEST_STREAM: stream,
        "gen_ai.request.max_tokens": 9,
        sc.RESPONSE_ID: rid,
        "gen_ai.response.model": "tiny",
        sc.FINISH_REASONS: ("length",),
        sc.INPUT_TOKENS: 40,
        sc.OUTPUT_TOKENS: output,
        sc.RESPONSE_TIME_TO_FIRST_CHUNK: ttfc,
        "server.address": "127.0.0.1",
        "server.port": 8000,
    }
    return {k: v for k, v in a.items() if v is not None}


def wire_attrs(**kw) -> dict:
    """genai_attrs for the hand-made wire helper (its arrays are of ints)."""
    return {k: v for k, v in genai_attrs(**kw).items() if not isinstance(v, tuple)}


def sdk_call(engine: bool = True, error: bool = False, kind=SpanKind.CLIENT, name="chat tiny", **kw) -> bytes:
    """One call traced by the SDK (a GenAI span, 300 ms) and, under its context as the server got
    it, our engine's request span (arrival 5 ms in, tokens at 40, 60, ... ms): one export body each."""
    exp = InMemorySpanExporter()
    tracer = provider(exp, service="app").get_tracer("opentelemetry.instrumentation.openai_v2")
    call = tracer.start_span(name, kind=kind, attributes=genai_attrs(**kw), start_time=T0)
    if engine:
        eng = tracer.start_span(
            sc.SPAN_REQUEST,
            context=set_span_in_context(call),
            kind=SpanKind.SERVER,
            start_time=T0 + 5 * MS,
            attributes={
                sc.REQUEST_ID: "chatcmpl-1",
                sc.TOKEN_EVENT_OFFSETS: [35 * MS + i * 30 * MS for i in range(9)],
                sc.TOKEN_EVENT_TOKENS: [1] * 9,
            },
        )
        eng.end(end_time=T0 + 290 * MS)
    if error:
        call.set_status(Status(StatusCode.ERROR, "boom"))
    call.end(end_time=T0 + 300 * MS)
    return encode_spans(exp.get_finished_spans()).SerializeToString()


@pytest.mark.parametrize("walker", ["c", "python"])
def test_a_streamed_call_is_a_client_record_paired_with_the_engine(walker):
    b, rm = records(sdk_call(), walker=walker)
    c, e = sorted(b.records(), key=lambda r: r.boundary)
    assert (c.boundary, c.request_id, c.model, c.status) == ("client", "chatcmpl-1", "tiny", "ok")
    assert c.ttft == pytest.approx(0.06, abs=1e-9) and c.e2e == pytest.approx(0.3, abs=1e-9)
    assert c.tpot == pytest.approx((0.3 - 0.06) / 8, abs=1e-9)  # the mean: the span gives no more
    assert (c.input_tokens, c.output_tokens) == (40, 9)
    assert c.events_summarised and c.itl_max is None  # its two events are no ITL
    assert c.paired and e.paired and c.peer_request_id == e.request_id == "chatcmpl-1"
    assert c.to_engine == pytest.approx(0.005, abs=1e-9)  # the call's start -> the engine's arrival
    assert e.itl_max == pytest.approx(0.03, abs=1e-9) and not e.events_summarised
    assert len(rm.itl) == 8  # the engine's gaps alone
    assert not c.violations and not e.violations


def test_a_call_that_did_not_stream_has_e2e_and_tokens_but_no_ttft():
    b, _ = records(sdk_call(engine=False, ttfc=None, stream=False))
    (c,) = b.records()
    assert c.boundary == "client" and c.ttft is None and c.tpot is None
    assert c.e2e == pytest.approx(0.3) and c.output_tokens == 9


def test_a_failed_call_is_an_error():
    b, _ = records(sdk_call(engine=False, error=True))
    (c,) = b.records()
    assert c.status == "error"


@pytest.mark.parametrize(
    "kw",
    [
        dict(kind=SpanKind.INTERNAL),  # a span an application named "chat ..."
        dict(kind=SpanKind.SERVER),
        dict(operation="embeddings", name="chat tiny"),  # no text generated
        dict(operation=None),
        dict(name="chatty tiny"),  # not the convention's name
    ],
)
def test_spans_that_are_not_a_genai_call_make_no_client_record(kw):
    b, _ = records(sdk_call(**kw))
    assert [r.boundary for r in b.records()] == ["engine"]


def test_a_trace_with_our_client_span_is_derived_from_ours_alone():
    """Our client (instrument_openai) and a GenAI instrumentation on the same call: one client
    record, ours, with its per-chunk events."""
    ours = span(
        1,
        0x77,
        sc.SPAN_CLIENT_REQUEST,
        T0,
        T0 + 300 * MS,
        {sc.REQUEST_ID: "c-1", sc.TOKEN_EVENT_OFFSETS: [50 * MS, 80 * MS], sc.TOKEN_EVENT_TOKENS: [1, 8]},
        kind=3,
    )
    theirs = span(1, 0x78, "chat tiny", T0, T0 + 300 * MS, wire_attrs(), kind=3)
    b, _ = records(body(ours, theirs, service="app"))
    (c,) = b.records()
    assert c.request_id == "c-1" and c.ttft == pytest.approx(0.05) and not c.events_summarised


@pytest.mark.parametrize(
    "kw, ttft, output",
    [
        (dict(ttfc="0.06"), None, 9),
        (dict(ttfc=-0.1), None, 9),
        (dict(ttfc=float("nan")), None, 9),
        (dict(ttfc=1e300), None, 9),
        (dict(ttfc=0.5), None, 9),  # after the call's end
        (dict(output=-3), 0.06, None),  # the count unknown; the first chunk still times the TTFT
        (dict(output="9"), 0.06, None),
        (dict(output=0), None, 0),  # no token: no first chunk
        (dict(rid=7), 0.06, 9),
    ],
)
def test_attributes_absent_wrong_or_out_of_range_are_unknown(kw, ttft, output):
    """Hand-shaped at the wire level: a value of the wrong type or out of range is unknown."""
    b, _ = records(body(span(2, 0x22, "chat tiny", T0, T0 + 300 * MS, wire_attrs(**kw), kind=3)))
    (c,) = b.records()
    assert c.boundary == "client"
    assert c.ttft == (None if ttft is None else pytest.approx(ttft))
    if output is None:  # unknown, never the first chunk's one token nor 0
        assert c.output_tokens is None and not c.estimated_tokens and c.tpot is None
    else:
        assert c.output_tokens == output and not c.estimated_tokens
    if "rid" in kw:
        assert c.request_id == (0x22).to_bytes(8, "big").hex()  # not a string: the span id
    assert c.itl_max is None and (c.tpot is None or not math.isnan(c.tpot))


def test_the_call_span_arriving_after_the_engines_trace_was_derived_is_derived_on_its_own():
    """The application exports its span after the engine's (the call ends last): once the engine's
    trace was released, the client's span is not a late engine span to drop but a client boundary
    not yet derived."""
    data = decode_payload(sdk_call()).spans
    engine = [s for s in data if s[3] != 17]
    call = [s for s in data if s[3] == 17]
    asm = TraceAssembler(AssemblyConfig(grace_s=0.1, peer_wait_s=0.5, timeout_s=30))
    asm.add(engine, 0.0)
    first = derive(asm.expire(10.0))[0].records()
    asm.add(call, 10.0)
    assert asm.counters.spans_late == 0 and asm.counters.spans_late_derived == 1
    (c,) = derive(asm.flush())[0].records()
    assert [r.boundary for r in first] == ["engine"] and c.boundary == "client" and not c.paired
