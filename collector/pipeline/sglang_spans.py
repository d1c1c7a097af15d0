"""SGLang's own request tracing as an engine boundary (``--enable-trace``; span shapes from
``python/sglang/srt/tracing/trace.py`` and ``trace_metric_wrapper.py`` in the SGLang repository).

SGLang sends, for each request, one trace: a root span ``Req <first 8 characters of the rid>``
(attribute ``rid``) from the tokenizer manager's receipt to the request's end; a span per thread
that handled it (its name says the thread, host and pid); and under those, a span per stage, by
the trace level (``--trace-level``): at 1 ``tokenize``, ``request_process``, ``prefill_waiting`` (the
scheduler's queue) and ``prefill_forward``; at 2 also ``dispatch`` and ``decode_loop`` (one per
decode iteration); at 3 also ``chunked_prefill``. Every span has wall-clock times.

The root becomes an engine request span (request id: ``rid``; E2E: the root), with:

* ``front_end``: the root's start -> the first ``prefill_waiting`` (tokenizing, the hand-off);
* ``queue``: the first ``prefill_waiting``; first scheduled at its end;
* ``prefill``: first scheduled -> the end of the last ``prefill_forward`` (first token generated);
* at level 2: ``decode`` (first token -> the end of the last ``decode_loop``) and the tokens
  generated (one a ``decode_loop``, the output tokens).

SGLang says nothing of when it handed a token out, so the record has no token events: its TTFT,
TPOT, ITL and stall layers are unknown, never the generation times under another name; paired with
a client, the client's TTFT splits at the first token generated (``delivery`` from there). A span named ``Req
...`` without a string ``rid`` is not taken as SGLang's (it stays an engine request span that says
nothing); a trace with several SGLang roots gives its stage spans to none of them.
"""

from __future__ import annotations

import numpy as np

from . import walked_span as sp
from .adopted_spans import Adopted, Phases, flag_outside, within

_STAGES = (
    sp.SG_TOKENIZE,
    sp.SG_DISPATCH,
    sp.SG_REQUEST_PROCESS,
    sp.SG_PREFILL_WAITING,
    sp.SG_PREFILL_FORWARD,
    sp.SG_CHUNKED_PREFILL,
    sp.SG_DECODE_LOOP,
)


def is_sglang_root(s: tuple) -> bool:
    """An engine request span with SGLang's ``rid`` and none of our attributes."""
    return type(s[sp.SGLANG_RID]) is str and s[sp.OFFSETS] is None and s[sp.REQUEST_ID] is None


def phases(root: tuple, stages: list[tuple]) -> Phases:
    """What one request's stage spans say (see the module docstring)."""
    by: dict[int, list[tuple]] = {}
    for s in sorted(stages, key=lambda s: s[sp.START]):
        by.setdefault(s[sp.CODE], []).append(s)
    out = Phases()
    waiting = by.get(sp.SG_PREFILL_WAITING)
    if waiting:
        w = waiting[0]
        out.front_end = w[sp.START] - root[sp.START] if w[sp.START] >= root[sp.START] else None
        out.queue = w[sp.END] - w[sp.START]
        out.first_scheduled = w[sp.END]
    forward = by.get(sp.SG_PREFILL_FORWARD)
    if forward:
        if out.first_scheduled is None:
            out.first_scheduled = forward[0][sp.START]
        out.first_generated = max(f[sp.END] for f in forward)
        out.prefill = out.first_generated - out.first_scheduled
    loops = by.get(sp.SG_DECODE_LOOP)
    if loops and out.first_generated is not None:
        ends = np.array([out.first_generated] + [d[sp.END] for d in loops], np.int64)
        ends.sort()
        out.generated = ends
        out.decode = int(ends[-1] - ends[0])
    return out


def adopt(batch: Adopted) -> None:
    """SGLang's roots of a batch made engine request spans, with their :class:`Phases` from the
    stage spans of their trace (in place; one look at each engine request span)."""
    codes, tix = batch.codes, batch.tix
    eng = np.flatnonzero(codes == sp.ENGINE).tolist()
    roots = [i for i in eng if is_sglang_root(batch.flat[i])]
    if not roots:
        return
    per_trace: dict[int, list[int]] = {}
    for i in roots:
        per_trace.setdefault(int(tix[i]), []).append(i)
    stage_at = np.flatnonzero(np.isin(codes, _STAGES)).tolist()
    stages: dict[int, list[tuple]] = {}
    for j in stage_at:
        stages.setdefault(int(tix[j]), []).append(batch.flat[j])
    flat = list(batch.flat)
    for t, rs in per_trace.items():
        for i in rs:
            s = flat[i]
            row = list(s)
            row[sp.REQUEST_ID] = s[sp.SGLANG_RID]
            mine = stages.get(t, []) if len(rs) == 1 else []
            inside = [g for g in mine if s[sp.START] <= g[sp.START] <= g[sp.END] <= s[sp.END]]
            ph, outside = within(phases(s, inside), s[sp.START], s[sp.END])
            if outside or len(inside) < len(mine):  # stages that cannot be this request's: unknown, and said
                flag_outside(row)
            if ph.generated is not None:
                row[sp.OUTPUT_TOKENS] = len(ph.generated)
            flat[i] = tuple(row)
            batch.phases[(t, s[sp.SPAN_ID])] = ph
    batch.flat = flat
