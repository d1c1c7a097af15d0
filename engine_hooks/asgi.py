"""The HTTP server boundary: an ASGI middleware that records each HTTP request the server takes.

One span per request, kind SERVER, after the OpenTelemetry HTTP server conventions (name
``{method} {path}``, ``http.request.method``, ``url.path``, ``http.response.status_code``), with
``llm.boundary = server``: it starts when the server read the request's first bytes and ends when
the last body chunk was written, and carries the time the app was called (``llm.http.app_start_
offset_ns``: HTTP parsing and the wait for the event loop before it), the time the response
started and the time of every body chunk written (``llm.http.chunk_offsets_ns``, ns after the
span's start, like the token events; no SSE payload is read). The first byte's time comes from
uvicorn's protocol (:func:`instrument_uvicorn`: the parser's message-begin callback for httptools,
the ``data_received`` that brought a new request for h11, O(1) a request); under another server,
or for the first request before the stamp is installed, the span starts when the app is called.
The caller's ``traceparent`` parents it, and the middleware hands the request on with its own
``traceparent``, so the engine's ``llm.request`` becomes its child.

Cheap on the event loop. Under uvicorn with the C accelerator built, each connection's transport
is a :class:`engine_hooks.hot_path._hotpath.TimedTransport` (:func:`instrument_uvicorn`): the response's
head and each body chunk are timed as uvicorn writes them, in C, and the app gets the server's
``send`` untouched; under another server, the app's ``send`` is wrapped (a
:class:`engine_hooks.hot_path._hotpath.TimedSend`, or :class:`_TimedSend` in Python). Either way the record
is a plain tuple, built into a span later on the tracing pipeline's thread or in the span process
(a RAW event, as the engine hooks record). vLLM's API server
takes it through the plugin (``OTEL_LLM_ENABLE=1``) or as ``--middleware
engine_hooks.asgi.TracingMiddleware``. Health probes and metric scrapes get no span
(``OTEL_PYTHON_ASGI_EXCLUDED_URLS`` / ``OTEL_PYTHON_EXCLUDED_URLS``, as OpenTelemetry's ASGI
instrumentation reads them; default ``/health``, ``/ping``, ``/metrics``, ``/version``, ``/load``).
"""

from __future__ import annotations

import binascii
import contextvars
import functools
import os
import re
from array import array

from otel_llm import environment
from otel_llm.clock import monotonic_ns

from .hot_path import hook_events as events
from .hot_path.batch_scan import _hotpath, accelerated

_TRACEPARENT = b"traceparent"
_TRACESTATE = b"tracestate"
_SEEN = "otel_llm.http_traced"  # scope key: an inner copy of the middleware passes through
FIRST_BYTE = "otel_llm.first_byte_mono_ns"  # scope key: when the server began reading the request
TIMED_TRANSPORT = "otel_llm.timed_transport"  # scope key: the connection's TimedTransport
_PATCHED = "_otel_llm_patched"


def _timed_transport(transport):
    """A new connection's transport, timed where the C accelerator is built and on."""
    if _hotpath is None or not accelerated():
        return transport
    try:
        return _hotpath.TimedTransport(transport)
    except Exception:  # a transport without write(): left as it is
        return transport


def _time_connections(protocol: type) -> None:
    """Make ``protocol`` (one of uvicorn's HTTP protocols) write through a timed transport."""
    made = protocol.connection_made

    @functools.wraps(made)
    def connection_made(self, transport) -> None:
        made(self, _timed_transport(transport))

    protocol.connection_made = connection_made


def instrument_uvicorn() -> bool:
    """Make uvicorn put, into each HTTP request's ASGI scope, the monotonic ns at which its
    protocol began reading the request (``FIRST_BYTE``) and, where the C accelerator is built,
    the connection's :class:`~engine_hooks.hot_path._hotpath.TimedTransport` (``TIMED_TRANSPORT``): every
    connection's transport is wrapped when it is made, so that the middleware times its response's
    writes there. Idempotent; False where uvicorn is not installed."""
    done = False
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        HttpToolsProtocol = None
    if HttpToolsProtocol is not None and not getattr(HttpToolsProtocol.on_message_begin, _PATCHED, False):
        begin = HttpToolsProtocol.on_message_begin

        def on_message_begin(self) -> None:
            t = monotonic_ns()
            begin(self)
            scope = self.scope
            scope[FIRST_BYTE] = t
            if type(self.transport) is not _TRANSPORT_TYPE:
                return
            scope[TIMED_TRANSPORT] = self.transport

        setattr(on_message_begin, _PATCHED, True)
        HttpToolsProtocol.on_message_begin = on_message_begin
        _time_connections(HttpToolsProtocol)
        done = True
    try:
        from uvicorn.protocols.http.h11_impl import H11Protocol
    except ImportError:
        return done
    if not getattr(H11Protocol.data_received, _PATCHED, False):
        received, handle = H11Protocol.data_received, H11Protocol.handle_events

        def data_received(self, data: bytes) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and getattr(self, "_otel_llm_first", None) is None:  # these bytes begin a request
                self._otel_llm_first = monotonic_ns()
            received(self, data)

        def handle_events(self) -> None:
            handle(self)
            scope = getattr(self, "scope", None)  # the new request's, read by its task once this returns
            if scope is None:
                return
            if type(self.transport) is _TRANSPORT_TYPE:  # a pipelined request's too: it has no first byte
                scope[TIMED_TRANSPORT] = self.transport
            first = getattr(self, "_otel_llm_first", None)
            if first is not None and FIRST_BYTE not in scope:
                scope[FIRST_BYTE] = first
                self._otel_llm_first = None  # taken: the next bytes after this request begin another

        setattr(data_received, _PATCHED, True)
        H11Protocol.data_received, H11Protocol.handle_events = data_received, handle_events
        _time_connections(H11Protocol)
    return True


_TRANSPORT_TYPE = _hotpath.TimedTransport if _hotpath is not None else None


class _TimedSend:
    """:class:`engine_hooks.hot_path._hotpath.TimedSend` in Python (no C accelerator, or
    ``OTEL_LLM_PURE_PYTHON``): the app's ``send``, timing the response."""

    __slots__ = ("send", "started", "status", "times")

    def __init__(self, send):
        self.send = send
        self.times = array("q")
        self.status = self.started = None

    def __call__(self, message):
        # hands back send's own awaitable: no coroutine of ours per chunk
        typ = message.get("type")
        if typ == "http.response.body":
            if message.get("body"):
                self.times.append(monotonic_ns())
        elif typ == "http.response.start":
            self.started = monotonic_ns()
            self.status = message.get("status")
        return self.send(message)

    def take(self) -> tuple:
        """(status, the response's start, the chunks' times as bytes), as the C one gives them."""
        return self.status, self.started, self.times.tobytes()


_FLAGS_TAIL = [b"-%02x" % f for f in range(256)]  # a traceparent's end, by its flags


def _field_name(h) -> bytes | None:
    """A header's name as lowercase bytes (ASGI's bytes, or a str), else None."""
    k = h[0] if isinstance(h, (tuple, list)) and h else None
    if isinstance(k, str):
        k = k.encode("latin-1", "replace")
    return k.lower() if isinstance(k, bytes) else None


def take_traceparent(headers: list) -> tuple[bytes, bytes, int] | None:
    """:func:`engine_hooks.hot_path._hotpath.take_traceparent` in Python, and for headers that are not ASGI's
    (a str name, list pairs): the caller's W3C trace context taken out of ``headers``, in place.
    The first header named ``traceparent`` (in any case) is the parent where valid
    (:func:`parse_traceparent`); every header of that name is removed, so that a second one cannot
    reach the app, and where no valid parent was found every ``tracestate`` too (a new trace
    starts, and another trace's state is none of its business). (trace id, span id, flags), or None."""
    names = [_field_name(h) for h in headers]
    parent, found = None, False
    for h, k in zip(headers, names):
        if k == _TRACEPARENT and not found:
            found = True
            parent = parse_traceparent(h[1])
    drop = {_TRACEPARENT} if parent else {_TRACEPARENT, _TRACESTATE}
    if any(k in drop for k in names):
        headers[:] = [h for h, k in zip(headers, names) if k not in drop]
    return parent


def make_traceparent(trace_id: bytes, span_id: bytes, flags: int) -> bytes:
    """:func:`engine_hooks.hot_path._hotpath.traceparent` in Python: the W3C header value, version 00."""
    return b"00-" + binascii.hexlify(trace_id) + b"-" + binascii.hexlify(span_id) + _FLAGS_TAIL[flags]


# W3C trace context's traceparent, as the OpenTelemetry propagator reads it: lowercase hex, each
# field its exact width, optional spaces or tabs around; a version after 00 may carry more after "-"
_TRACEPARENT_FORM = re.compile(rb"[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^\r\n]*)?[ \t]*")


def parse_traceparent(value: bytes | str | None) -> tuple[bytes, bytes, int] | None:
    """(trace id, span id, flags) of a valid W3C traceparent, else None: the version ``ff``, a
    version 00 with anything after its flags, an all-zero id or any other form is invalid, and an
    invalid header is ignored as if absent."""
    if isinstance(value, str):
        try:
            value = value.encode("ascii")
        except UnicodeEncodeError:
            return None
    if not isinstance(value, bytes):
        return None
    m = _TRACEPARENT_FORM.fullmatch(value)
    if m is None or m[1] == b"ff" or (m[1] == b"00" and m[5]):
        return None
    t, s = binascii.unhexlify(m[2]), binascii.unhexlify(m[3])
    if not any(t) or not any(s):
        return None
    return t, s, int(m[4], 16)


_server_recorder = None  # () -> Recorder: the pipeline of the engine this process serves


def serve_engine(recorder_of) -> None:
    """Say where a middleware built without a recorder records (vLLM's ``--middleware``, Starlette's
    ``add_middleware``): ``recorder_of()`` gives the recorder of the engine this process serves,
    whose spans the server spans must join. The engine's adapter calls it (``engine_hooks.vllm``);
    without one, the process's default pipeline."""
    global _server_recorder
    _server_recorder = recorder_of


def _expand(tracker, mono: int, rec: tuple) -> None:
    tracker.http_done.append(rec)  # engine_hooks.spans.tracker.HttpRecord's fields, made a record when built


#: a proxy's (:func:`trace_proxy`): the traceparent of the HTTP request it is serving, which its
#: outgoing calls carry (:func:`instrument_http_clients`)
outgoing_traceparent: contextvars.ContextVar[bytes | None] = contextvars.ContextVar(
    "otel_llm_outgoing_traceparent", default=None
)


def _add_traceparent(headers) -> None:
    """Put the served request's traceparent into an outgoing call's headers (httpx's ``Headers``
    or a dict), unless the caller set one itself."""
    tp = outgoing_traceparent.get()
    if tp is not None and "traceparent" not in headers:
        headers["traceparent"] = tp.decode("ascii")


def instrument_http_clients() -> list[str]:
    """Make the HTTP clients a Python proxy calls its backends with (httpx, sync and async;
    aiohttp) send the traceparent of the request the proxy is serving (:data:`outgoing_traceparent`),
    so that each backend's server span is the child of the proxy's. Only within a request a
    :func:`trace_proxy` middleware serves; a call that sets its own ``traceparent`` keeps it.
    Idempotent; returns the clients hooked."""
    done = []
    try:
        import httpx
    except ImportError:
        httpx = None
    if httpx is not None:
        for cls in (httpx.Client, httpx.AsyncClient):
            send = cls.send
            if not getattr(send, _PATCHED, False):

                def make(send):
                    @functools.wraps(send)
                    def traced_send(self, request, *args, **kwargs):
                        _add_traceparent(request.headers)
                        return send(self, request, *args, **kwargs)  # the coroutine, for AsyncClient

                    setattr(traced_send, _PATCHED, True)
                    return traced_send

                cls.send = make(send)
            done.append(f"httpx.{cls.__name__}")
    try:
        import aiohttp
    except ImportError:
        return done
    request = aiohttp.ClientSession._request
    if not getattr(request, _PATCHED, False):

        @functools.wraps(request)
        def traced_request(self, method, url, *args, **kwargs):
            if outgoing_traceparent.get() is not None:
                headers = dict(kwargs.get("headers") or {})
                _add_traceparent(headers)
                kwargs["headers"] = headers
            return request(self, method, url, *args, **kwargs)

        setattr(traced_request, _PATCHED, True)
        aiohttp.ClientSession._request = traced_request
    done.append("aiohttp.ClientSession")
    return done


def trace_proxy(app, service_name: str = "llm-proxy"):
    """Trace a Python ASGI proxy or router (FastAPI, Starlette, any ASGI app) with one call:
    ``app = trace_proxy(app)``. Each HTTP request it serves gets its server span (as vLLM's API
    server does, :class:`TracingMiddleware`), and the calls it makes to its backends with httpx or
    aiohttp while serving it carry that span's ``traceparent`` (:func:`instrument_http_clients`):
    a disaggregated request's prefill and decode legs land in the client's trace, under the
    proxy's span. The spans go where the standard ``OTEL_*`` variables say, as the process's
    ``service.name`` (``OTEL_SERVICE_NAME`` wins over ``service_name``)."""
    instrument_http_clients()
    return TracingMiddleware(app, forward=True, service_name=service_name)


class TracingMiddleware:
    """ASGI middleware (a class, as vLLM's ``--middleware`` and Starlette's ``add_middleware`` take).
    ``forward``: the app is a proxy, whose outgoing calls carry this request's ``traceparent``
    (:func:`trace_proxy`); ``service_name``: the process's, where no engine's pipeline records
    the spans."""

    def __init__(self, app, recorder=None, forward: bool = False, service_name: str | None = None):

        self.app = app
        self._recorder = recorder
        self._forward = forward
        self._service_name = service_name
        instrument_uvicorn()  # for the requests after this one (Starlette builds middleware on the first)
        self._excluded = environment.excluded_urls()  # health probes, metric scrapes: no span
        self._excluded_paths: dict[str, bool] = {}
        from otel_llm.otlp.sdk_internals import configured_sampler, sampler_shortcut, shortcut_decision

        self._sampler = configured_sampler()
        self._shortcut = sampler_shortcut(self._sampler)  # the usual samplers, decided without the SDK
        self._quick = shortcut_decision
        # the response timed in C where the accelerator is built: below ASGI under uvicorn (the
        # connection's TimedTransport), else as the app's send; the traceparent read and written
        c = _hotpath if accelerated() else None
        self._timed_send = c.TimedSend if c else None
        self._timer = self._timed_send or _TimedSend
        self._take = c.take_traceparent if c else take_traceparent
        self._traceparent = c.traceparent if c else make_traceparent

    def _is_excluded(self, path: str) -> bool:
        """Whether ``path`` gets no span (``OTEL_PYTHON_ASGI_EXCLUDED_URLS``); a server's few paths
        are looked up once each (at most 1,024 remembered)."""
        hit = self._excluded_paths.get(path)
        if hit is None:
            hit = self._excluded.search(path) is not None
            if len(self._excluded_paths) < 1024:
                self._excluded_paths[path] = hit
        return hit

    @property
    def recorder(self):
        if self._recorder is None:
            if _server_recorder is not None:
                self._recorder = _server_recorder()
            else:
                from .pipeline import default_pipeline

                named = {"service_name": self._service_name} if self._service_name else {}
                self._recorder = default_pipeline(**named).recorder
        return self._recorder

    def _decide(self, parent, trace_id: bytes, scope) -> tuple[bool, float | None]:
        """The configured sampler's decision for this request (a parent-based one follows the
        caller's flag), and the probability where it decided itself."""
        quick = self._quick(self._shortcut, None if parent is None else bool(parent[2] & 1))
        if quick is not None:  # the usual samplers, decided without a context
            return quick
        from opentelemetry import trace as trace_api
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

        from otel_llm.otlp.sdk_internals import sampling_probability

        tid = int.from_bytes(trace_id, "big")
        ctx = None
        if parent is not None:
            sc_ = SpanContext(tid, int.from_bytes(parent[1], "big"), True, TraceFlags(parent[2] & 1))
            ctx = trace_api.set_span_in_context(NonRecordingSpan(sc_))
        name = f"{scope.get('method', '')} {scope.get('path', '')}"
        if not self._sampler.should_sample(ctx, tid, name, SpanKind.SERVER).decision.is_sampled():
            return False, None
        return True, sampling_probability(self._sampler, parent is not None)

    def _begin(self, scope) -> tuple:
        """What the span needs before the app runs: its start, ids, the caller's parent, the
        sampling decision and the headers the app gets (the caller's trace context replaced by
        ours). Whatever it raises, the caller serves the request untraced."""
        t_app = monotonic_ns()
        t0 = min(scope.get(FIRST_BYTE) or t_app, t_app)
        headers = list(scope.get("headers") or ())
        try:  # every traceparent out (and a tracestate that belongs to no parent): ours goes in
            parent = self._take(headers)
        except TypeError:  # not ASGI's shape: looked at in Python
            parent = take_traceparent(headers)
        ids = os.urandom(24)  # one read of the system's randomness: the span's id, and a trace's if new
        trace_id = parent[0] if parent else ids[8:]
        span_id = ids[:8]
        sampled, p = self._decide(parent, trace_id, scope)
        flags = (parent[2] & ~1 if parent else 0) | int(sampled)  # the engine's spans follow this decision
        headers.append((_TRACEPARENT, self._traceparent(trace_id, span_id, flags)))
        return t_app, t0, trace_id, span_id, parent, sampled, p, headers

    async def __call__(self, scope, receive, send):
        if scope.get(_SEEN):  # an outer copy of this middleware traces it
            await self.app(scope, receive, send)
            return
        if scope.get("type") != "http" or (self._excluded is not None and self._is_excluded(scope.get("path", ""))):
            transport = scope.get(TIMED_TRANSPORT)
            if transport is not None:  # the connection's last traced response is complete by now:
                transport.timer = None  # not this one's writes, if its app has not returned yet
            await self.app(scope, receive, send)
            return
        try:
            t_app, t0, trace_id, span_id, parent, sampled, p, headers = self._begin(scope)
        except Exception:  # tracing never breaks the server: this request goes untraced
            transport = scope.get(TIMED_TRANSPORT)
            if transport is not None:
                transport.timer = None
            await self.app(scope, receive, send)
            return
        timer = self._timer(send)
        transport = scope.get(TIMED_TRANSPORT) if self._timed_send is not None else None
        if transport is not None:
            transport.timer = timer  # this response's writes, timed as uvicorn writes them
        forwarded = outgoing_traceparent.set(headers[-1][1]) if self._forward else None
        try:
            await self.app({**scope, "headers": headers, _SEEN: True}, receive, timer if transport is None else send)
        finally:
            end = monotonic_ns()
            if forwarded is not None:
                outgoing_traceparent.reset(forwarded)
            try:
                if transport is not None and transport.timer is timer:
                    transport.timer = None
                status, started, chunks = timer.take()
                rec = (  # engine_hooks.spans.tracker.HttpRecord's fields, in order
                    t0,
                    end,
                    scope.get("method", ""),
                    scope.get("path", ""),
                    status,
                    started,
                    chunks,
                    trace_id,
                    span_id,
                    parent[1] if parent else None,
                    parent[2] if parent else 1,
                    sampled,
                    p,
                    t_app,
                )
                self.recorder.record(events.raw(end, _expand, rec))
            except Exception:  # tracing never breaks the server
                pass
