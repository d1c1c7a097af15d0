"""Tracing the official ``openai`` SDK without changing anything its caller sees.

:func:`instrument` patches one client's ``completions.create`` and ``chat.completions.create``
(sync or async) so that each call records one ``llm.client.request`` span, and injects the W3C
``traceparent`` through ``extra_headers``. What the caller gets back is what the SDK returns:

* ``stream=True``: the SDK's own ``Stream`` / ``AsyncStream`` object (its class becomes a
  subclass of the SDK's, so ``isinstance``, ``.response``, ``with``, ``async with``, ``close()``
  and iteration behave as the SDK's do). To count tokens exactly the call asks for
  ``stream_options.include_usage``; when the caller did not ask for it, the usage-only chunk
  (``choices == []``) is consumed here and never reaches the caller.
* a stream closed or abandoned before its end closes the HTTP response (the server sees the
  disconnect and aborts the request) and is recorded ``cancelled``;
* ``stream=False``: the response object, unchanged; the span has E2E, tokens from ``usage`` and
  the status, but no token events (nothing arrives before the whole response: no TTFT, no ITL);
* ``with_raw_response`` / ``with_streaming_response``: the SDK's response object, whose
  ``parse()`` result is traced as above; ``with_options(...)`` / ``copy(...)`` return a client
  that is traced too.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import weakref
from typing import Any

from opentelemetry import trace as trace_api

from .. import semconv as sc
from ..clock import WallAnchor
from ..semconv import Boundary, RequestStatus
from .client_span import (
    PROPAGATOR,
    REJECTED_HTTP,
    ClientResult,
    StreamRecorder,
    capture_content_default,
    finish_span,
    send_tracer,
    start_client_span,
)

_INSTRUMENTED = "_otel_llm_instrumented"
_WHY = {
    RequestStatus.CANCELLED: "the stream was closed before its end",
    "dropped": "the stream was dropped unread",
    "unparsed": "the response was dropped unparsed",
}


#: traceparent -> the call being sent, for the httpx event hook that stamps when the SDK's HTTP
#: client began writing it (:func:`_hook_sends`)
_SENDING: dict[str, _Call] = {}


def _hook_sends(client: Any, is_async: bool) -> None:
    """Add to the SDK's httpx client a request hook that hands each traced request httpcore's trace
    extension (:func:`~otel_llm.client.client_span.send_tracer`), so the span knows when the request began
    to be written. Once per httpx client; a client the SDK was not built on (no ``event_hooks``) is
    left alone, and its spans carry no send time."""
    http = getattr(client, "_client", None)
    hooks = getattr(http, "event_hooks", None)
    if not isinstance(hooks, dict) or getattr(http, _INSTRUMENTED, False):
        return

    def give(request) -> None:
        call = _SENDING.get(request.headers.get("traceparent", ""))
        if call is not None:
            request.extensions["trace"] = send_tracer(call.res, call.now, is_async)

    if is_async:

        async def on_request(request) -> None:
            give(request)

    else:
        on_request = give
    hooks.setdefault("request", []).append(on_request)
    http.event_hooks = hooks
    setattr(http, _INSTRUMENTED, True)


def _chunk_dict(chunk) -> dict:
    return chunk.model_dump() if hasattr(chunk, "model_dump") else dict(chunk)


class _Call:
    """One traced call: its span, what the client saw, and whether it has ended."""

    def __init__(self, tracer, now, capture: bool, kwargs: dict, op: str):
        self.now, self.capture, self.kwargs = now, capture, kwargs
        self.streaming = bool(kwargs.get("stream"))
        submit = now()
        self.span, self.sibling = start_client_span(
            tracer,
            submit,
            {
                sc.BOUNDARY: Boundary.CLIENT,
                sc.OPERATION_NAME: op,
                sc.STREAMING: self.streaming,
                sc.REQUEST_STREAM: self.streaming,
                **({sc.REQUEST_MODEL: kwargs["model"]} if kwargs.get("model") else {}),
            },
        )
        headers = dict(kwargs.get("extra_headers") or {})
        PROPAGATOR.inject(headers, context=trace_api.set_span_in_context(self.span))
        kwargs["extra_headers"] = headers
        self.traceparent = headers.get("traceparent")
        if self.traceparent:
            _SENDING[self.traceparent] = self  # until its end: the SDK's retries send it again
        self.hide_usage = False
        if self.streaming:
            so = dict(kwargs.get("stream_options") or {})
            self.hide_usage = not so.get("include_usage")
            so["include_usage"] = True
            kwargs["stream_options"] = so
        self.res = ClientResult(request_id="", status=RequestStatus.OK, submit_ns=submit, end_ns=submit)
        self.rec = StreamRecorder()
        self.done = False

    def chunk(self, chunk) -> bool:
        """Record one streamed chunk; False for the usage-only chunk the caller did not ask for."""
        d = _chunk_dict(chunk)
        self.rec.chunk(d, self.now())
        return not (self.hide_usage and not d.get("choices") and d.get("usage") is not None)

    def response(self, obj) -> None:
        """A whole (non-streamed) response: its usage and id, then the end."""
        d = _chunk_dict(obj) if obj is not None else {}
        self.rec.response_id = d.get("id")
        self.rec.metrics(d)
        if d.get("usage"):
            self.rec.final_usage = d["usage"]
        self.end()

    def fail(self, exc: BaseException) -> None:
        if isinstance(exc, asyncio.CancelledError):  # the caller gave up (wait_for, task.cancel())
            self.end(RequestStatus.CANCELLED)
            return
        code = getattr(exc, "status_code", None)
        self.res.http_status = code
        self.res.status = RequestStatus.REJECTED if code in REJECTED_HTTP else RequestStatus.ERROR
        self.res.error = f"{type(exc).__name__}: {exc}"[:500]
        self.end()

    def end(self, status: str | None = None, why: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        _SENDING.pop(self.traceparent, None)
        if status is not None and self.res.status == RequestStatus.OK:
            self.res.status = status
            self.res.error = _WHY.get(why or status)
        finish_span(self.span, self.res, self.rec, self.kwargs, self.now(), self.capture, self.sibling)


def _sync_chunks(orig, call: _Call):
    try:
        for chunk in orig:
            if call.chunk(chunk):
                yield chunk
    except GeneratorExit:  # closed or abandoned before its end
        call.end(RequestStatus.CANCELLED)
        orig.close()  # the SDK's own generator closes the HTTP response
        raise
    except BaseException as exc:
        call.fail(exc)
        raise
    call.end()


async def _async_chunks(orig, call: _Call):
    try:
        async for chunk in orig:
            if call.chunk(chunk):
                yield chunk
    except (GeneratorExit, asyncio.CancelledError):
        call.end(RequestStatus.CANCELLED)
        await orig.aclose()
        raise
    except BaseException as exc:
        call.fail(exc)
        raise
    call.end()


_traced_classes: dict[type, type] = {}


def _traced_class(cls: type, is_async: bool) -> type:
    """A subclass of the SDK's stream class (same layout, so an instance can take it) whose
    ``close()`` ends the span first (cancelled, unless the stream was read to its end)."""
    t = _traced_classes.get(cls)
    if t is not None:
        return t
    if is_async:

        async def close(self) -> None:
            try:
                await self._iterator.aclose()
            finally:
                await cls.close(self)

    else:

        def close(self) -> None:
            try:
                self._iterator.close()
            finally:
                cls.close(self)

    close.__doc__ = cls.close.__doc__
    ns = {"close": close, "__module__": cls.__module__, "__doc__": cls.__doc__, _INSTRUMENTED: True}
    t = _traced_classes[cls] = type(cls.__name__, (cls,), ns)
    t.__qualname__ = cls.__qualname__
    return t


def _is_stream(obj) -> tuple[bool, bool]:
    """(is an SDK stream, is async)."""
    import openai

    return isinstance(obj, (openai.Stream, openai.AsyncStream)), isinstance(obj, openai.AsyncStream)


def _trace_result(obj, call: _Call):
    """The SDK's return value, traced in place (see the module docstring)."""
    stream, is_async = _is_stream(obj)
    if stream:
        if not getattr(type(obj), _INSTRUMENTED, False):
            obj._iterator = (_async_chunks if is_async else _sync_chunks)(obj._iterator, call)
            obj.__class__ = _traced_class(type(obj), is_async)
            weakref.finalize(obj, call.end, RequestStatus.CANCELLED, "dropped")  # never read: ends when it goes
        return obj
    parse = getattr(obj, "parse", None)
    if parse is not None and hasattr(obj, "http_response"):  # with_raw_response / with_streaming_response
        _trace_parse(obj, parse, call)
        weakref.finalize(
            obj, call.end, RequestStatus.CANCELLED, "unparsed"
        )  # never parsed: ends when the response goes
        return obj
    call.response(obj)
    return obj


def _trace_parse(resp, parse, call: _Call) -> None:
    if inspect.iscoroutinefunction(parse):

        async def traced_parse(*a, **k):
            return _trace_result(await parse(*a, **k), call)

    else:

        def traced_parse(*a, **k):
            return _trace_result(parse(*a, **k), call)

    resp.parse = traced_parse


def instrument(client: Any, *, tracer_provider=None, capture_content: bool | None = None) -> Any:
    """Trace ``client`` (``openai.OpenAI`` or ``openai.AsyncOpenAI``) in place; returns it. A client
    instrumented already is returned as it is."""
    if getattr(client, _INSTRUMENTED, False):
        return client
    from ..otlp.tracing import default_provider

    tracer = (tracer_provider or default_provider()).get_tracer("otel_llm.client", "0.1.0")
    anchor = WallAnchor()
    capture = capture_content_default() if capture_content is None else capture_content
    now = lambda: anchor.wall_ns(time.monotonic_ns())
    import openai

    is_async = isinstance(client, openai.AsyncOpenAI)  # its create() methods are coroutine functions

    def wrap(create, op: str):
        if is_async:

            async def traced(*args, **kwargs):
                call = _Call(tracer, now, capture, kwargs, op)
                try:
                    result = await create(*args, **kwargs)
                except BaseException as exc:
                    call.fail(exc)
                    raise
                return _trace_result(result, call)

        else:

            def traced(*args, **kwargs):
                call = _Call(tracer, now, capture, kwargs, op)
                try:
                    result = create(*args, **kwargs)
                except BaseException as exc:
                    call.fail(exc)
                    raise
                return _trace_result(result, call)

        traced.__wrapped__ = create
        return traced

    _hook_sends(client, is_async)
    client.completions.create = wrap(client.completions.create, "text_completion")
    client.chat.completions.create = wrap(client.chat.completions.create, "chat")
    copy = client.copy

    def traced_copy(*args, **kwargs):
        return instrument(copy(*args, **kwargs), tracer_provider=tracer_provider, capture_content=capture_content)

    client.copy = client.with_options = traced_copy
    setattr(client, _INSTRUMENTED, True)
    return client
