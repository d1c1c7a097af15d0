"""A GenAI client instrumentation's span as the client boundary.

An application whose LLM calls are traced by an OpenTelemetry GenAI instrumentation (the openai SDK's,
a framework's) sends one span per call, named ``{gen_ai.operation.name} {gen_ai.request.model}``
(``chat tiny-llama``), kind CLIENT, with ``gen_ai.operation.name``, ``gen_ai.request.model``,
``gen_ai.usage.input_tokens`` / ``output_tokens``, ``gen_ai.response.id`` and, for a streamed call,
``gen_ai.response.time_to_first_chunk`` (seconds). Its W3C context reaches the server, so the
engine's spans are in the same trace. Derivation takes such a span, for an operation that generates
text (``chat``, ``text_completion``, ``generate_content``), as a client request span of its own:

* the call's start is the client's submit and its end the client's end (E2E: the span);
* the record's token events are the two moments the span gives: the first chunk at
  ``time_to_first_chunk`` (1 token) and the rest at the span's end (``output_tokens - 1``), marked
  ``events_summarised``: TTFT, E2E, mean TPOT and the TTFT's parts (paired with the engine) are
  known; the ITL, largest gap and stalls are unknown, never computed from the two events;
* a call that did not stream (no ``time_to_first_chunk``) has no token event: E2E, token counts and
  status only, as otel-llm's own client records a ``stream=False`` call;
* without a usable ``gen_ai.usage.output_tokens`` (a stream without ``stream_options.include_usage``
  gives the instrumentation none) the record's token count is unknown (NULL, never 0 nor the one
  token of its first chunk): left out of token throughput, its TPOT unknown;
* its request id is ``gen_ai.response.id`` (the server's id for the response), else the span id;
  where its trace context did not reach the server, that id pairs it with the server's and the
  engine's records (:mod:`~collector.pipeline.assembly`, ``paired_by`` ``id``);
* a trace that also holds otel-llm's own client span is derived from that one alone.

An attribute of the wrong type or out of range is left unknown, as a missing one is; a span of
another kind or operation with such a name (a ``chat room`` span of an application) is not taken.
"""

from __future__ import annotations

import numpy as np

from otel_llm import semconv as sc

from . import walked_span as sp
from .adopted_spans import Adopted
from .vllm_spans import duration_ns, token_count

_KIND_CLIENT = 3  # OTLP Span.SpanKind.SPAN_KIND_CLIENT
_OPERATIONS = frozenset(sc.GENAI_CLIENT_OPERATIONS)


def is_genai_client_span(s: tuple) -> bool:
    """A CLIENT span of an operation that generates text, carrying none of otel-llm's token events."""
    return s[sp.KIND] == _KIND_CLIENT and s[sp.OPERATION] in _OPERATIONS and s[sp.OFFSETS] is None


def as_client_span(s: tuple) -> tuple:
    """The instrumentation's span as one of our client request spans (see the module docstring)."""
    row = list(s)
    row[sp.CODE] = sp.CLIENT
    rid = s[sp.RESPONSE_ID]
    row[sp.REQUEST_ID] = rid if type(rid) is str and rid else s[sp.SPAN_ID].hex()
    n = token_count(s[sp.OUTPUT_TOKENS])
    row[sp.OUTPUT_TOKENS] = n
    row[sp.INPUT_TOKENS] = token_count(s[sp.INPUT_TOKENS])
    span_ns = s[sp.END] - s[sp.START]
    ttfc = duration_ns(s[sp.TIME_TO_FIRST_CHUNK])
    offsets: list[int] = []
    tokens: list[int] = []
    if ttfc is not None and ttfc <= span_ns and n != 0:  # a first chunk: one token at least
        offsets, tokens = [ttfc], [1]
        if n is not None and n > 1:
            offsets.append(span_ns)
            tokens.append(n - 1)
    row[sp.OFFSETS] = np.asarray(offsets, np.int64).tobytes()
    row[sp.TOKENS] = np.asarray(tokens, np.int64).tobytes()
    return tuple(row)


def adopt(batch: Adopted) -> None:
    """The batch's GenAI client spans made client request spans (in place), except in a trace that
    holds one of ours; the rest stay spans derivation does not read."""
    at = np.flatnonzero(batch.codes == sp.GENAI_CLIENT).tolist()
    theirs = [i for i in at if is_genai_client_span(batch.flat[i])]
    if not theirs:
        return
    tix = batch.tix
    ours_in = set(tix[batch.codes == sp.CLIENT].tolist())
    flat = list(batch.flat)
    codes = batch.codes.copy()
    for i in theirs:
        if int(tix[i]) in ours_in:
            continue
        flat[i] = as_client_span(flat[i])
        codes[i] = sp.CLIENT
        batch.summarised[i] = True
    batch.flat, batch.codes = flat, codes
