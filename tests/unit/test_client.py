"""Client-side tracing against a fake OpenAI-compatible streaming server."""

import asyncio

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_llm import semconv as sc
from otel_llm.client.traced import TracedClient, instrument_openai
from otel_llm.otlp.tracing import make_provider


@pytest.fixture
def spans():
    mem = InMemorySpanExporter()
    tp = make_provider(exporter=mem)
    yield tp, mem


def run(coro):
    return asyncio.run(coro)


def one_span(mem):
    tp_spans = [s for s in mem.get_finished_spans() if s.name == sc.SPAN_CLIENT_REQUEST]
    assert len(tp_spans) == 1
    return tp_spans[0]


@pytest.mark.parametrize(
    "usage, multi, estimated",
    [("continuous", 1, False), ("continuous", 3, False), ("final", 1, False), ("none", 1, True), ("final", 2, True)],
)
def test_token_events_and_usage(server, spans, usage, multi, estimated):
    tp, mem = spans

    async def go():
        async with TracedClient(server.base_url, model="m", tracer_provider=tp) as c:
            return await c.completion(
                [1, 2, 3], 6, request_id="r1", extra={"fake_usage": usage, "fake_multi": multi, "fake_gap_ms": 3}
            )

    res = run(go())
    tp.force_flush()
    s = one_span(mem)
    a = s.attributes
    assert res.status == "ok" and s.kind.name == "CLIENT"
    assert a[sc.REQUEST_ID] == "r1" and a[sc.BOUNDARY] == "client" and a[sc.STATUS] == "ok"
    expected_events = -(-6 // multi)
    assert len(a[sc.TOKEN_EVENT_OFFSETS]) == expected_events
    assert a[sc.TOKEN_EVENT_ESTIMATED] is estimated
    assert a[sc.OUTPUT_TOKENS] == 6
    if not estimated:
        assert sum(a[sc.TOKEN_EVENT_TOKENS]) == 6
    assert list(a[sc.TOKEN_EVENT_OFFSETS]) == sorted(a[sc.TOKEN_EVENT_OFFSETS])
    assert s.start_time <= s.start_time + a[sc.TOKEN_EVENT_OFFSETS][-1] <= s.end_time
    # W3C trace context reached the server: the engine's spans would join this trace
    tp_header = server.requests[-1]["headers"]["traceparent"]
    assert tp_header.split("-")[1] == format(s.context.trace_id, "032x")
    assert tp_header.split("-")[2] == format(s.context.span_id, "016x")
    body = server.requests[-1]["body"]
    assert body["stream"] is True and body["stream_options"]["include_usage"] is True
    assert "llm.prompt.text" not in a and "llm.completion.text" not in a  # no content unless opted in


def test_chat_role_only_chunk_is_not_an_event(server, spans):
    tp, _ = spans

    async def go():
        async with TracedClient(server.base_url, tracer_provider=tp) as c:
            return await c.chat([{"role": "user", "content": "hi"}], 3, extra={"fake_usage": "none"})

    res = run(go())
    tp.force_flush()
    assert len(res.events_ns) == 3 and res.request_id == "chat-1"


@pytest.mark.parametrize("code, status", [(429, "rejected"), (503, "rejected"), (500, "error"), (400, "error")])
def test_http_errors(server, spans, code, status):
    tp, mem = spans

    async def go():
        async with TracedClient(server.base_url, tracer_provider=tp) as c:
            return await c.completion("x", 4, extra={"fake_status": code})

    res = run(go())
    tp.force_flush()
    s = one_span(mem)
    assert res.status == status and s.attributes[sc.STATUS] == status and s.status.status_code.name == "ERROR"
    assert s.attributes[sc.ERROR_TYPE] == str(code) and s.attributes[sc.TOKEN_EVENT_OFFSETS] == ()


def test_cancelled_mid_stream(server, spans):
    tp, mem = spans

    async def go():
        async with TracedClient(server.base_url, tracer_provider=tp) as c:
            task = asyncio.create_task(c.completion("x", 100, extra={"fake_gap_ms": 20}))
            while not server.requests:  # sent
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.4)  # about 20 of the 100 chunks are in
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(go())
    tp.force_flush()
    s = one_span(mem)
    assert s.attributes[sc.STATUS] == "cancelled"
    assert 1 <= len(s.attributes[sc.TOKEN_EVENT_OFFSETS]) < 100


def test_connection_refused_is_an_error(spans):
    tp, _ = spans

    async def go():
        async with TracedClient("http://127.0.0.1:9/v1", tracer_provider=tp) as c:
            return await c.completion("x", 4)

    res = run(go())
    assert res.status == "error" and "Connect" in res.error


def test_capture_content_is_opt_in(server, spans):
    tp, mem = spans

    async def go():
        async with TracedClient(server.base_url, tracer_provider=tp, capture_content=True) as c:
            return await c.completion("hello", 2)

    run(go())
    tp.force_flush()
    a = one_span(mem).attributes
    assert a["llm.completion.text"] == "xx" and "hello" in a["llm.prompt.text"]


def test_openai_sdk_wrapper(server, spans):
    openai = pytest.importorskip("openai")
    tp, mem = spans
    client = instrument_openai(openai.OpenAI(base_url=server.base_url, api_key="x"), tracer_provider=tp)
    chunks = list(
        client.completions.create(model="m", prompt="hi", max_tokens=5, stream=True, extra_body={"fake_usage": "final"})
    )
    # 5 token chunks: the usage-only chunk the wrapper asked for (the caller did not) is not handed out
    assert len(chunks) == 5 and all(c.choices for c in chunks)
    tp.force_flush()
    s = one_span(mem)
    assert len(s.attributes[sc.TOKEN_EVENT_OFFSETS]) == 5 and s.attributes[sc.TOKEN_EVENT_ESTIMATED] is False
    assert server.requests[-1]["headers"]["traceparent"].split("-")[1] == format(s.context.trace_id, "032x")


def _sent_before_read(span, request) -> int:
    """The span's send offset (the client library began writing the request), checked against the
    span and the moment the server read the request's head (one host, Unix ns)."""
    off = span.attributes[sc.CLIENT_SEND_OFFSET]
    first = span.attributes[sc.TOKEN_EVENT_OFFSETS][0]
    assert off >= 0 and span.start_time + off <= request["read_ns"] <= span.start_time + first
    return off


def test_the_span_says_when_the_request_began_to_be_written(server, spans):
    """The client's time before the bytes go out (building the request, a pooled connection, the
    connect) is not network: httpcore's trace events give the moment it began writing, on every
    idiom (our client, the SDK sync and async), new connection or kept alive."""
    openai = pytest.importorskip("openai")
    tp, mem = spans

    async def ours():
        async with TracedClient(server.base_url, model="m", tracer_provider=tp) as c:
            for i in range(2):  # a new connection, then the kept-alive one
                await c.completion("hi", 3, request_id=f"o{i}")

    run(ours())
    sdk = instrument_openai(openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0), tracer_provider=tp)
    list(sdk.completions.create(model="m", prompt="hi", max_tokens=3, stream=True))
    sdk.completions.create(model="m", prompt="hi", max_tokens=3)  # not streamed: the send is known too

    async def sdk_async():
        c = instrument_openai(
            openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0), tracer_provider=tp
        )
        async for _ in await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        ):
            pass

    run(sdk_async())
    tp.force_flush()
    got = sorted((s for s in mem.get_finished_spans() if s.name == sc.SPAN_CLIENT_REQUEST), key=lambda s: s.start_time)
    assert len(got) == 5 == len(server.requests)
    for s, req in zip(got, server.requests):
        if s.attributes.get(sc.TOKEN_EVENT_OFFSETS):
            _sent_before_read(s, req)
        else:
            off = s.attributes[sc.CLIENT_SEND_OFFSET]
            assert off >= 0 and s.start_time + off <= req["read_ns"] <= s.end_time
    from otel_llm.client.openai_wrapper import _SENDING

    assert not _SENDING  # every call's entry is gone at its end
