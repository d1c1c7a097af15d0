"""vLLM's own request span as an engine boundary: the zero-code path.

vLLM started with ``--otlp-traces-endpoint`` sends one ``llm_request`` span per finished request:
from its arrival at vLLM's front end to the request's end, with what vLLM measured as attributes in
seconds (``gen_ai.latency.*``) and the token counts (:mod:`otel_llm.semconv`, ``VLLM_*``). It has no
child spans and no token events. Derivation takes it as an engine request span of its own:

* the record's token events are the two moments the span gives: the first token at vLLM's TTFT
  (1 token) and the last at its E2E (the other ``completion_tokens - 1``), and the record is
  marked ``events_summarised``. Its TTFT, E2E, mean TPOT, token counts and throughput are known;
  its ITL, largest gap and stalls are unknown, never computed from the two events;
* ``queue``, ``prefill`` and ``decode`` are vLLM's durations, measured on the engine core's clock;
  where they lie on the wall clock is not said, so first scheduled / first generated (and the front
  end's own part) stay unknown;
* a trace that also holds our own engine request span is derived from ours alone: vLLM's spans in
  it are dropped.

An attribute of the wrong type or out of range is left unknown, as a missing one is.
"""

from __future__ import annotations

import math

import numpy as np

from . import walked_span as sp
from .adopted_spans import Adopted, Phases, flag_outside, within

_NS = 1e9
_MAX_NS = 2**62
_LATENCIES = (sp.LATENCY_TTFT, sp.LATENCY_E2E, sp.LATENCY_QUEUE, sp.LATENCY_PREFILL, sp.LATENCY_DECODE)


def is_vllm_span(s: tuple) -> bool:
    """An engine request span that carries vLLM's latencies and none of our token events."""
    return s[sp.OFFSETS] is None and any(s[i] is not None for i in _LATENCIES)


def duration_ns(v) -> int | None:
    """A latency attribute (seconds) as int ns; None where absent, not a number, negative or huge."""
    if type(v) not in (float, int) or not math.isfinite(v) or v < 0 or v * _NS >= _MAX_NS:
        return None
    return round(v * _NS)


def token_count(v) -> int | None:
    """A token count attribute as an int; None where absent, not an int, negative or huge."""
    return v if type(v) is int and 0 <= v < 2**31 else None


def as_engine_span(s: tuple) -> tuple:
    """vLLM's span as one of our engine request spans: request id, model and token counts from
    vLLM's attributes where ours are absent; the end at arrival + vLLM's E2E where that lies within
    the span (vLLM ends its span a little after its last output); the two token events."""
    row = list(s)
    if row[sp.REQUEST_ID] is None and type(s[sp.GENAI_REQUEST_ID]) is str:
        row[sp.REQUEST_ID] = s[sp.GENAI_REQUEST_ID]
    if row[sp.MODEL] is None and type(s[sp.RESPONSE_MODEL]) is str:
        row[sp.MODEL] = s[sp.RESPONSE_MODEL]
    if row[sp.INPUT_TOKENS] is None:
        row[sp.INPUT_TOKENS] = token_count(s[sp.PROMPT_TOKENS])
    n = token_count(s[sp.OUTPUT_TOKENS])
    n = token_count(s[sp.COMPLETION_TOKENS]) if n is None else n
    row[sp.OUTPUT_TOKENS] = n
    span_ns = s[sp.END] - s[sp.START]
    e2e = duration_ns(s[sp.LATENCY_E2E])
    if e2e is not None and e2e <= span_ns:
        row[sp.END] = s[sp.START] + e2e
        span_ns = e2e
    ttft = duration_ns(s[sp.LATENCY_TTFT])
    offsets: list[int] = []
    tokens: list[int] = []
    if n and ttft is not None and ttft <= span_ns:
        offsets, tokens = [ttft], [1]
        if n > 1 and e2e is not None and ttft <= e2e <= span_ns:
            offsets.append(e2e)
            tokens.append(n - 1)
    row[sp.OFFSETS] = np.asarray(offsets, np.int64).tobytes()
    row[sp.TOKENS] = np.asarray(tokens, np.int64).tobytes()
    return tuple(row)


def adopt(batch: Adopted) -> None:
    """vLLM's request spans of a batch made engine request spans (:func:`as_engine_span`) with
    their :class:`Phases`, and those in a trace that has one of ours left out (in place; one look
    at each engine request span)."""
    codes, tix = batch.codes, batch.tix
    eng = np.flatnonzero(codes == sp.ENGINE).tolist()
    is_theirs = [is_vllm_span(batch.flat[i]) for i in eng]
    theirs = [i for i, v in zip(eng, is_theirs) if v]
    if not theirs:
        return
    ours_in = {int(t) for t, v in zip(tix[eng].tolist(), is_theirs) if not v}
    flat = list(batch.flat)
    keep = np.ones(len(flat), bool)
    for i in theirs:
        t = int(tix[i])
        if t in ours_in:
            keep[i] = False
            continue
        row = as_engine_span(flat[i])
        batch.summarised[i] = True
        q, p, d = phases_ns(row)
        ph, outside = within(Phases(queue=q, prefill=p, decode=d), row[sp.START], row[sp.END])
        if outside:  # vLLM's durations do not fit in its own span: unknown, and said
            row = list(row)
            flag_outside(row)
            row = tuple(row)
        flat[i] = row
        batch.phases[(t, row[sp.SPAN_ID])] = ph
    if not keep.all():
        at = np.flatnonzero(keep)
        flat = [flat[i] for i in at.tolist()]
        batch.codes, batch.tix, batch.summarised = codes[at], tix[at], batch.summarised[at]
    batch.flat = flat


def phases_ns(s: tuple) -> tuple[int | None, int | None, int | None]:
    """(queue, prefill, decode) of one of vLLM's spans, int ns on the engine core's clock."""
    return duration_ns(s[sp.LATENCY_QUEUE]), duration_ns(s[sp.LATENCY_PREFILL]), duration_ns(s[sp.LATENCY_DECODE])
