"""The ``llm.client.request`` span, shared by every client the project traces (its own httpx client
and the ``openai`` SDK wrapper): the call's result, the stream-chunk recorder that turns SSE chunks
into token events, and the span's start and finish. The rules are those of :mod:`otel_llm.client`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from opentelemetry import trace as trace_api
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .. import environment
from .. import semconv as sc
from ..metrics.timeline import Timeline
from ..otlp.sdk_internals import tracer_probability
from ..semconv import RequestStatus

PROPAGATOR = TraceContextTextMapPropagator()
REJECTED_HTTP = (429, 503)


def capture_content_default() -> bool:
    return environment.env_bool(environment.CAPTURE_MESSAGE_CONTENT)


@dataclass
class ClientResult:
    """What one request looked like from the caller's side. Times: Unix ns."""

    request_id: str  # the id we sent (x-request-id) or the response's id
    status: str
    submit_ns: int
    end_ns: int
    events_ns: list[int] = field(default_factory=list)
    event_tokens: list[int] = field(default_factory=list)
    estimated: bool = False
    output_tokens: int = 0  # from usage when the server sent it, else counted
    input_tokens: int | None = None
    http_status: int | None = None
    error: str | None = None
    text: str = ""  # the completion, for the caller; never put in spans unless opted in
    trace_id: str | None = None
    sent_ns: int | None = None  # the client library began writing the request (None: not seen)

    def timeline(self) -> Timeline:
        return Timeline(
            id=self.request_id,
            submit=self.submit_ns / 1e9,
            end=self.end_ns / 1e9,
            status=self.status,
            events=tuple((t / 1e9, k) for t, k in zip(self.events_ns, self.event_tokens)),
            input_tokens=self.input_tokens,
        )


@dataclass
class _Choice:
    """One choice's side of a stream (``n`` > 1 gives several): its token events and text."""

    events_ns: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    estimated_events: int = 0  # events counted from text (1 each), not from usage
    text_parts: list[str] = field(default_factory=list)


def _empty_token(choice: dict, delta: dict) -> bool:
    """A chunk whose output text is empty but present, neither the chat stream's opening role
    chunk nor a closing chunk with only a finish reason: a token that decodes to no text (vLLM
    sends one chunk per engine output, each with at least one token)."""
    has_text = choice.get("text") is not None or delta.get("content") is not None
    return has_text and delta.get("role") is None and choice.get("finish_reason") is None


class StreamRecorder:
    """Turns SSE chunks (already parsed JSON) into token events, per choice: one event per chunk
    in which a choice has output. Token counts come from the usage the server sends with the
    chunks (a delta of ``completion_tokens``), else one per chunk (estimated)."""

    def __init__(self) -> None:
        self.choices: dict[int, _Choice] = {}
        self.prev_completion: int | None = None
        self.final_usage: dict | None = None
        self.response_id: str | None = None
        self.speculation: dict | None = None  # the server's own account (vLLM's metrics.speculative_decoding)

    def metrics(self, obj: dict) -> None:
        """The per-request metrics a server puts on its last chunk or its body (vLLM's ``metrics``
        with ``--per-request-spec-decode-metrics``): its speculative-decoding account is kept."""
        m = obj.get("metrics")
        if type(m) is dict and type(m.get("speculative_decoding")) is dict:
            self.speculation = m["speculative_decoding"]

    def chunk(self, obj: dict, t_ns: int) -> None:
        self.response_id = self.response_id or obj.get("id")
        if "metrics" in obj:
            self.metrics(obj)
        choices = obj.get("choices") or []
        usage = obj.get("usage")
        if usage and not choices:
            self.final_usage = usage  # usage-only chunk: not a token event
            return
        n = None
        if usage and usage.get("completion_tokens") is not None:
            cur = int(usage["completion_tokens"])
            n = cur - (self.prev_completion or 0)  # the chunk's new tokens, all choices together
            self.prev_completion = cur
            self.final_usage = usage
        for ch in choices:
            delta = ch.get("delta") or {}
            text = (ch.get("text") or "") + (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            c = self.choices.setdefault(int(ch.get("index") or 0), _Choice())
            if text:
                c.text_parts.append(text)
            k = n if n is not None and len(choices) == 1 else None
            if k is None and (text or _empty_token(ch, delta)):
                k = 1
                c.estimated_events += 1
            if k and k > 0:
                c.events_ns.append(t_ns)
                c.tokens.append(k)

    def finish(self) -> list[tuple[int, _Choice, bool, int]]:
        """Each choice seen (none: choice 0, empty), in index order, as (index, choice, estimated,
        output tokens) after reconciling the counts with the final usage."""
        chosen = sorted(self.choices.items()) or [(0, _Choice())]
        total = (self.final_usage or {}).get("completion_tokens")
        counted = sum(sum(c.tokens) for _, c in chosen)
        out = []
        for i, c in chosen:
            estimated = c.estimated_events > 0
            if estimated and total is not None and int(total) == counted:
                estimated = False  # every chunk carried one token: the counts are exact
            n = int(total) if total is not None and len(chosen) == 1 else sum(c.tokens)
            out.append((i, c, estimated, n))
        return out

    @property
    def input_tokens(self) -> int | None:
        inp = (self.final_usage or {}).get("prompt_tokens")
        return int(inp) if inp is not None else None


#: span attribute <- the key of vLLM's per-request speculative-decoding account (all ints)
_SPECULATION_KEYS = {
    sc.SPECULATION_DRAFT_TOKENS: "num_draft_tokens",
    sc.SPECULATION_ACCEPTED_TOKENS: "num_accepted_draft_tokens",
    sc.SPECULATION_VERIFY_STEPS: "num_spec_steps",
    sc.SPECULATION_K: "num_spec_tokens",
}


def speculation_attributes(account: dict | None) -> dict:
    """A server's per-request speculative-decoding account (vLLM's ``metrics.speculative_decoding``)
    as ``llm.client.request`` attributes: its counts, and its per-verify-step arrays where it sent
    them; nothing where a count is missing or not a non-negative int (its rates are left out: they
    follow from the counts, and vLLM says 0 where nothing was drafted)."""
    if not account:
        return {}
    out = {k: v for k, key in _SPECULATION_KEYS.items() if type(v := account.get(key)) is int and v >= 0}
    if not all(
        k in out for k in (sc.SPECULATION_DRAFT_TOKENS, sc.SPECULATION_ACCEPTED_TOKENS, sc.SPECULATION_VERIFY_STEPS)
    ):
        return {}
    drafted, accepted = account.get("per_step_drafted"), account.get("per_step_accepted")
    if (
        type(drafted) is list
        and type(accepted) is list
        and len(drafted) == len(accepted)
        and all(type(x) is int and x >= 0 for x in drafted + accepted)
    ):
        out[sc.SPECULATION_STEP_DRAFTS], out[sc.SPECULATION_STEP_ACCEPTED] = drafted, accepted
    return out


def start_client_span(tracer, start_ns: int, attributes: dict):
    """The ``llm.client.request`` span of a call, and a function that starts another for each
    further choice of a call that turns out to have several (``n`` > 1): a child of the first (so
    in its trace even when the first is a root), with the same start and attributes. A span kept
    by a sampler that decided itself says with what probability (``llm.sampling.probability``)."""
    p = tracer_probability(tracer)
    if p is not None and p < 1.0:
        attributes = {**attributes, sc.SAMPLING_PROBABILITY: p}
    first = tracer.start_span(sc.SPAN_CLIENT_REQUEST, kind=SpanKind.CLIENT, start_time=start_ns, attributes=attributes)
    ctx = trace_api.set_span_in_context(first)

    def another():
        return tracer.start_span(
            sc.SPAN_CLIENT_REQUEST, context=ctx, kind=SpanKind.CLIENT, start_time=start_ns, attributes=attributes
        )

    return first, another


#: httpcore's trace events for the moment it begins writing a request (HTTP/1.1, HTTP/2)
SEND_EVENTS = frozenset({"http11.send_request_headers.started", "http2.send_request_headers.started"})


def send_tracer(res: ClientResult, now, is_async: bool):
    """An httpx ``trace`` extension that stamps ``res.sent_ns`` with ``now()`` when httpcore begins
    writing the request (the last such moment, should a dead pooled connection make it write again)."""
    if is_async:

        async def trace(name: str, info: dict) -> None:
            if name in SEND_EVENTS:
                res.sent_ns = now()

        return trace

    def trace_sync(name: str, info: dict) -> None:
        if name in SEND_EVENTS:
            res.sent_ns = now()

    return trace_sync


def finish_span(
    span,
    res: ClientResult,
    rec: StreamRecorder,
    body: dict,
    end_ns: int,
    capture_content: bool,
    sibling=None,
) -> None:
    """Fill ``res`` from the stream and end the ``llm.client.request`` span at ``end_ns``. A
    request with several choices (``n`` > 1) is one span per choice, each with its index
    (``llm.request.choice``): ``span`` carries the first, ``sibling()`` starts one for each of the
    others (see :func:`start_client_span`); ``res`` describes the first."""
    res.end_ns = end_ns
    res.input_tokens = rec.input_tokens if rec.input_tokens is not None else res.input_tokens
    if not res.request_id:
        res.request_id = rec.response_id or format(span.get_span_context().span_id, "016x")
    choices = rec.finish()
    several = len(choices) > 1
    for k, (index, choice, estimated, n_tokens) in enumerate(choices):
        if k == 0:
            s = span
            res.events_ns, res.event_tokens = choice.events_ns, choice.tokens
            res.estimated, res.output_tokens, res.text = estimated, n_tokens, "".join(choice.text_parts)
        elif sibling is not None:
            s = sibling()
        else:
            break
        a = {
            sc.REQUEST_ID: res.request_id,
            sc.STATUS: res.status,
            sc.OUTPUT_TOKENS: n_tokens,
            sc.TOKEN_EVENT_OFFSETS: [t - res.submit_ns for t in choice.events_ns],
            sc.TOKEN_EVENT_TOKENS: list(choice.tokens),
            sc.TOKEN_EVENT_ESTIMATED: estimated,
        }
        if several:
            a[sc.REQUEST_CHOICE] = index
        if choice.events_ns:
            a[sc.RESPONSE_TIME_TO_FIRST_CHUNK] = (choice.events_ns[0] - res.submit_ns) / 1e9
        if res.sent_ns is not None and res.submit_ns <= res.sent_ns <= res.end_ns:
            a[sc.CLIENT_SEND_OFFSET] = res.sent_ns - res.submit_ns
        if rec.response_id:
            a[sc.RESPONSE_ID] = rec.response_id
        if not several:  # the server's account of a request with one choice (vLLM: n = 1 only)
            a.update(speculation_attributes(rec.speculation))
        if res.input_tokens is not None:
            a[sc.INPUT_TOKENS] = res.input_tokens
        if res.http_status is not None:
            a["http.response.status_code"] = res.http_status
        if capture_content:
            a[sc.PROMPT_TEXT] = json.dumps(body.get("prompt") or body.get("messages"))
            a[sc.COMPLETION_TEXT] = "".join(choice.text_parts)
        s.set_attributes(a)
        if res.status != RequestStatus.OK:
            s.set_attribute(
                sc.ERROR_TYPE, res.status if res.http_status is None or res.http_status < 400 else str(res.http_status)
            )
            s.set_status(Status(StatusCode.ERROR, res.error or res.status))
        s.end(end_time=res.end_ns)
