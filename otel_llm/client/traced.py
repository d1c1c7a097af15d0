"""Client-side tracing for OpenAI-compatible streaming over HTTP: what the caller saw.

One ``llm.client.request`` span (CLIENT) per request, from the caller's call to the moment the
stream closes, carrying the token-event arrays of docs/architecture.md and the moment the client
library began writing the request (``llm.client.send_offset_ns``, from httpcore's trace events). A
W3C ``traceparent`` is injected, so the engine's spans (engine_hooks) join the same trace.

Token events: each streamed chunk that carries output is one event. Its token count comes from
streamed usage where the server sends it per chunk (vLLM: ``stream_options.continuous_usage_stats``);
otherwise each chunk with text counts as one token, reconciled with the final usage when the
server sends it (``stream_options.include_usage``); when they disagree, the counts stay as
counted and ``llm.token_event.estimated`` is true. Chunks with no token (role-only, usage-only,
keep-alive) are not events. No prompt or completion text is recorded unless
``capture_content=True`` (or ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``).

Status: ``ok``; ``rejected`` for HTTP 429 / 503 (the server refused it); ``error`` for other HTTP
errors or a broken stream; ``cancelled`` when the caller cancels (the exception is re-raised).
"""

from __future__ import annotations

import asyncio
import json
import time
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


class TracedClient:
    """An httpx-based async client for ``/v1/completions`` and ``/v1/chat/completions`` streaming.

    ``base_url``: e.g. ``http://127.0.0.1:8000/v1``. Each call returns a :class:`ClientResult`
    and records one ``llm.client.request`` span.
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        tracer_provider=None,
        capture_content: bool | None = None,
        timeout_s: float = 600.0,
        continuous_usage: bool = True,
        max_connections: int = 1000,
    ):
        import httpx

        from ..otlp.tracing import default_provider

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.capture_content = capture_content_default() if capture_content is None else capture_content
        self.continuous_usage = continuous_usage
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            headers=headers,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self._tracer = (tracer_provider or default_provider()).get_tracer("otel_llm.client", "0.1.0")
        self._anchor = WallAnchor()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> TracedClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def now_ns(self) -> int:
        """The client's clock: Unix ns, from one wall-clock anchor and the monotonic clock."""
        return self._anchor.wall_ns(time.monotonic_ns())

    async def completion(
        self,
        prompt: str | list[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        extra: dict | None = None,
        attributes: dict | None = None,
        on_cancel=None,
    ) -> ClientResult:
        """Stream one completion. ``on_cancel(result)`` is called with the partial result when
        the caller cancels (the CancelledError is then re-raised)."""
        body = {"prompt": prompt, "max_tokens": max_tokens}
        return await self._stream(
            "/completions",
            body,
            request_id,
            extra,
            attributes,
            input_tokens=len(prompt) if isinstance(prompt, list) else None,
            on_cancel=on_cancel,
        )

    async def chat(
        self,
        messages: list[dict],
        max_tokens: int,
        *,
        request_id: str | None = None,
        extra: dict | None = None,
        attributes: dict | None = None,
    ) -> ClientResult:
        return await self._stream(
            "/chat/completions", {"messages": messages, "max_tokens": max_tokens}, request_id, extra, attributes
        )

    async def _stream(
        self,
        path: str,
        body: dict,
        request_id: str | None,
        extra: dict | None,
        attributes: dict | None,
        input_tokens: int | None = None,
        on_cancel=None,
    ) -> ClientResult:
        body = {**body, "stream": True, **(extra or {})}
        if self.model and "model" not in body:
            body["model"] = self.model
        so = dict(body.get("stream_options") or {})
        so.setdefault("include_usage", True)
        if self.continuous_usage:
            so.setdefault("continuous_usage_stats", True)
        body["stream_options"] = so
        submit = self.now_ns()
        span, sibling = start_client_span(
            self._tracer,
            submit,
            {
                sc.BOUNDARY: Boundary.CLIENT,
                sc.OPERATION_NAME: "text_completion" if path == "/completions" else "chat",
                sc.REQUEST_STREAM: True,
                **({sc.REQUEST_MODEL: body["model"]} if body.get("model") else {}),
                **(attributes or {}),
            },
        )
        headers: dict[str, str] = {}
        PROPAGATOR.inject(headers, context=trace_api.set_span_in_context(span))
        if request_id:
            headers["X-Request-Id"] = request_id
        rec = StreamRecorder()
        res = ClientResult(
            request_id=request_id or "",
            status=RequestStatus.OK,
            submit_ns=submit,
            end_ns=submit,
            input_tokens=input_tokens,
            trace_id=format(span.get_span_context().trace_id, "032x"),
        )
        try:
            trace = {"trace": send_tracer(res, self.now_ns, is_async=True)}
            async with self._http.stream(
                "POST", self.base_url + path, json=body, headers=headers, extensions=trace
            ) as resp:
                res.http_status = resp.status_code
                if resp.status_code >= 400:
                    detail = (await resp.aread())[:500].decode(errors="replace")
                    res.status = RequestStatus.REJECTED if resp.status_code in REJECTED_HTTP else RequestStatus.ERROR
                    res.error = f"HTTP {resp.status_code}: {detail}"
                else:
                    async for line in resp.aiter_lines():
                        t = self.now_ns()
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        try:
                            obj = json.loads(data)
                        except json.JSONDecodeError:
                            continue
                        if obj.get("error"):
                            res.status, res.error = RequestStatus.ERROR, str(obj["error"])[:500]
                            continue
                        rec.chunk(obj, t)
        except asyncio.CancelledError:
            res.status, res.error = RequestStatus.CANCELLED, "cancelled by the caller"
            self._close(span, res, rec, body, sibling)
            if on_cancel is not None:
                on_cancel(res)
            raise
        except Exception as exc:
            res.status, res.error = RequestStatus.ERROR, f"{type(exc).__name__}: {exc}"
        self._close(span, res, rec, body, sibling)
        return res

    def _close(self, span, res: ClientResult, rec: StreamRecorder, body: dict, sibling) -> None:
        finish_span(span, res, rec, body, self.now_ns(), self.capture_content, sibling)


def instrument_openai(client: Any, *, tracer_provider=None, capture_content: bool | None = None) -> Any:
    """Trace the ``openai`` SDK's ``completions.create`` and ``chat.completions.create`` (sync or
    async client, streaming or not), changing nothing the caller sees; returns the same client.
    See :mod:`otel_llm.client.openai_wrapper`."""
    from .openai_wrapper import instrument

    return instrument(client, tracer_provider=tracer_provider, capture_content=capture_content)
