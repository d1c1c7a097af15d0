"""The HTTP server boundary: an ASGI middleware that records each HTTP request the server takes.

One span per request, kind SERVER, after the OpenTelemetry HTTP server conventions (name
``{method} {path}``, ``http.request.method``, ``url.path``, ``http.response.status_code``), with
``llm.boundary = server``: it starts when the server read the request's first bytes and ends when
the last body chunk was written, and carries the time the app was called (``llm.http.app_start_
offset_ns``: HTTP parsing and the wait for the event loop before it), the time the response
started and the time of every body chunk written (``llm.http.chunk_offsets_ns``, ns after the
span's start, like the token events; no SSE payload is read). The first byte's time comes from
uvicorn's protocol (:func:`stamp_first_byte`: the parser's message-begin callback for httptools,
the ``data_received`` that brought a new request for h11, O(1) a request); under another server,
or for the first request before the stamp is installed, the span starts when the app is called.
The caller's ``traceparent`` parents it, and the middleware hands the request on with its own
``traceparent``, so the engine's ``llm.request`` becomes its child.

Cheap on the event loop: a monotonic clock read per chunk, kept in C where the accelerator is
built (:class:`engine_hooks._hotpath.TimedSend`), else appended to an ``array('q')``; the span is built
later on the tracing pipeline's thread (a RAW event, as the engine hooks record). vLLM's API server
takes it through the plugin (``OTEL_LLM_ENABLE=1``) or as ``--middleware
engine_hooks.asgi.TracingMiddleware``. Health probes and metric scrapes get no span
(``OTEL_PYTHON_ASGI_EXCLUDED_URLS`` / ``OTEL_PYTHON_EXCLUDED_URLS``, as OpenTelemetry's ASGI
instrumentation reads them; default ``/health``, ``/ping``, ``/metrics``, ``/version``, ``/load``).
"""

from __future__ import annotations

import binascii
import operator
import os
from array import array
from dataclasses import dataclass, field

from otel_llm import environment
from otel_llm.clock import monotonic_ns

from .batch_scan import _hotpath, accelerated
from .recorder import RAW

_TRACEPARENT = b"traceparent"
_SEEN = "otel_llm.http_traced"  # scope key: an inner copy of the middleware passes through
FIRST_BYTE = "otel_llm.first_byte_mono_ns"  # scope key: when the server began reading the request
_STAMPED = "_otel_llm_stamped"


def stamp_first_byte() -> bool:
    """Make uvicorn put, into each HTTP request's ASGI scope, the monotonic ns at which its
    protocol began reading the request (``FIRST_BYTE``). Idempotent; False where uvicorn is not
    installed."""
    done = False
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        HttpToolsProtocol = None
    if HttpToolsProtocol is not None and not getattr(HttpToolsProtocol.on_message_begin, _STAMPED, False):
        begin = HttpToolsProtocol.on_message_begin

        def on_message_begin(self) -> None:
            t = monotonic_ns()
            begin(self)
            self.scope[FIRST_BYTE] = t

        setattr(on_message_begin, _STAMPED, True)
        HttpToolsProtocol.on_message_begin = on_message_begin
        done = True
    try:
        from uvicorn.protocols.http.h11_impl import H11Protocol
    except ImportError:
        return done
    if not getattr(H11Protocol.data_received, _STAMPED, False):
        received, handle = H11Protocol.data_received, H11Protocol.handle_events

        def data_received(self, data: bytes) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and getattr(self, "_otel_llm_first", None) is None:  # these bytes begin a request
                self._otel_llm_first = monotonic_ns()
            received(self, data)

        def handle_events(self) -> None:
            handle(self)
            scope = getattr(self, "scope", None)  # the new request's, read by its task once this returns
            first = getattr(self, "_otel_llm_first", None)
            if scope is not None and first is not None and FIRST_BYTE not in scope:
                scope[FIRST_BYTE] = first
                self._otel_llm_first = None  # taken: the next bytes after this request begin another

        setattr(data_received, _STAMPED, True)
        H11Protocol.data_received, H11Protocol.handle_events = data_received, handle_events
    return True


@dataclass(slots=True)
class HttpRecord:
    """One HTTP request at the server. Times are monotonic ns of this process."""

    start_mono: int  # the server began reading the request (else: the app was called)
    end_mono: int
    method: str
    path: str
    status: int | None
    response_start_mono: int | None
    chunk_mono: array = field(default_factory=lambda: array("q"))  # int64: pickled as one bytes object
    trace_id: bytes = b""
    span_id: bytes = b""
    parent_span_id: bytes | None = None
    parent_flags: int = 1
    sampled: bool = True  # the sampler's decision (OTEL_TRACES_SAMPLER), handed on in the traceparent
    probability: float | None = None  # what it kept the request with, where it decided itself
    app_start_mono: int = 0  # the app (this middleware) was called

    def to_wire(self) -> tuple:
        """Its fields in order, the chunk times as their bytes: what goes to the span process
        (pickled as a dataclass, through a ``__reduce__`` and the array's own, it took three times
        the instructions)."""
        t = _HTTP_FIELDS(self)
        return t[:_CHUNKS] + (t[_CHUNKS].tobytes(),) + t[_CHUNKS + 1 :]

    @classmethod
    def from_wire(cls, t: tuple) -> HttpRecord:
        """The record :meth:`to_wire` gave."""
        chunks = array("q")
        chunks.frombytes(t[_CHUNKS])
        return cls(*t[:_CHUNKS], chunks, *t[_CHUNKS + 1 :])


_HTTP_FIELDS = operator.attrgetter(*HttpRecord.__dataclass_fields__)
_CHUNKS = tuple(HttpRecord.__dataclass_fields__).index("chunk_mono")


_NO_CHUNKS = array("q")  # never appended to: a request's own array replaces it at its end
_HEADER_NAME = operator.itemgetter(0)
_FLAGS_TAIL = [b"-%02x" % f for f in range(256)]  # a traceparent's end, by its flags


def _find_traceparent(headers: list) -> int:
    """The index of the first ``traceparent`` header, or -1. ASGI servers lowercase header names
    (uvicorn does): looked up among the names in C; any other case only where the names hold
    it."""
    names = list(map(_HEADER_NAME, headers))
    if _TRACEPARENT in names:
        return names.index(_TRACEPARENT)
    try:
        if _TRACEPARENT not in b"\n".join(names).lower():
            return -1
    except TypeError:  # a name that is not bytes (not ASGI's): each looked at
        pass
    for i, k in enumerate(names):
        if isinstance(k, bytes) and k.lower() == _TRACEPARENT:
            return i
    return -1


def parse_traceparent(value: bytes | str | None) -> tuple[bytes, bytes, int] | None:
    """(trace id, span id, flags) of a W3C traceparent, or None."""
    if not value:
        return None
    if type(value) is bytes and len(value) == 55 and value[:3] == b"00-" and value[35] == value[52] == 45:
        # version 00, the usual header: read at its fixed places in C (no decode, split or str per part)
        try:
            t, s = binascii.unhexlify(value[3:35]), binascii.unhexlify(value[36:52])
            flags = binascii.unhexlify(value[53:55])[0]  # two hex digits, as W3C writes them
        except ValueError:  # binascii.Error is one
            return None
        if not any(t) or not any(s):
            return None
        return t, s, flags
    try:
        text = value.decode("ascii") if isinstance(value, bytes) else value
        ver, tid, sid, flags = text.strip().split("-")[:4]
        t, s = bytes.fromhex(tid), bytes.fromhex(sid)
        if len(ver) != 2 or ver == "ff" or len(t) != 16 or len(s) != 8 or not any(t) or not any(s):
            return None
        return t, s, int(flags, 16)
    except (ValueError, UnicodeDecodeError):
        return None


_server_recorder = None  # () -> Recorder: the pipeline of the engine this process serves


def serve_engine(recorder_of) -> None:
    """Say where a middleware built without a recorder records (vLLM's ``--middleware``, Starlette's
    ``add_middleware``): ``recorder_of()`` gives the recorder of the engine this process serves,
    whose spans the server spans must join. The engine's adapter calls it (``engine_hooks.vllm``);
    without one, the process's default pipeline."""
    global _server_recorder
    _server_recorder = recorder_of


def _expand(tracker, mono: int, rec: HttpRecord) -> None:
    tracker.http_done.append(rec)


class TracingMiddleware:
    """ASGI middleware (a class, as vLLM's ``--middleware`` and Starlette's ``add_middleware`` take)."""

    def __init__(self, app, recorder=None):

        self.app = app
        self._recorder = recorder
        stamp_first_byte()  # for the requests after this one (Starlette builds middleware on the first)
        self._excluded = environment.excluded_urls()  # health probes, metric scrapes: no span
        self._excluded_paths: dict[str, bool] = {}
        from otel_llm.otlp.sdk_internals import configured_sampler, sampler_shortcut, shortcut_decision

        self._sampler = configured_sampler()
        self._shortcut = sampler_shortcut(self._sampler)  # the usual samplers, decided without the SDK
        self._quick = shortcut_decision
        # each body chunk timed in C where the accelerator is built (no Python frame per chunk)
        self._timed_send = _hotpath.TimedSend if accelerated() else None

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

                self._recorder = default_pipeline().recorder
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

    async def __call__(self, scope, receive, send):
        if (
            scope.get("type") != "http"
            or scope.get(_SEEN)
            or (self._excluded is not None and self._is_excluded(scope.get("path", "")))
        ):
            await self.app(scope, receive, send)
            return
        t_app = monotonic_ns()
        t0 = min(scope.get(FIRST_BYTE) or t_app, t_app)
        headers = list(scope.get("headers") or ())
        parent = None
        i = _find_traceparent(headers)
        if i >= 0:
            parent = parse_traceparent(headers[i][1])
            del headers[i]
        ids = os.urandom(24)  # one read of the system's randomness: the span's id, and a trace's if new
        trace_id = parent[0] if parent else ids[8:]
        span_id = ids[:8]
        sampled, p = self._decide(parent, trace_id, scope)
        flags = (parent[2] & ~1 if parent else 0) | int(sampled)  # the engine's spans follow this decision
        tp = b"00-" + binascii.hexlify(trace_id) + b"-" + binascii.hexlify(span_id) + _FLAGS_TAIL[flags]
        headers.append((_TRACEPARENT, tp))
        timed = self._timed_send
        rec = HttpRecord(
            t0,
            t0,
            scope.get("method", ""),
            scope.get("path", ""),
            None,
            None,
            _NO_CHUNKS if timed is not None else array("q"),  # TimedSend keeps them until the end
            trace_id,
            span_id,
            parent[1] if parent else None,
            parent[2] if parent else 1,
            sampled,
            p,
            t_app,
        )
        if timed is not None:
            traced_send = timed(send, rec)
        else:
            chunk = rec.chunk_mono.append

            def traced_send(message):
                # a plain function handing back send's own awaitable: no coroutine of ours per chunk
                typ = message.get("type")
                if typ == "http.response.body":
                    if message.get("body"):
                        chunk(monotonic_ns())
                elif typ == "http.response.start":
                    rec.response_start_mono = monotonic_ns()
                    rec.status = message.get("status")
                return send(message)

        try:
            await self.app({**scope, "headers": headers, _SEEN: True}, receive, traced_send)
        finally:
            rec.end_mono = monotonic_ns()
            try:
                if timed is not None:
                    rec.chunk_mono = traced_send.chunks()
                self.recorder.record((RAW, rec.end_mono, _expand, rec))
            except Exception:  # tracing never breaks the server
                pass
