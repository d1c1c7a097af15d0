"""What must hold for every request's timeline, checked on every derived record and counted, never
clamped away: the ordering inside a boundary and the nesting of the boundaries around each other.

Each record gets the kinds it violates (the ``violations`` column, comma-separated, ``None`` when it
holds); the collector counts them by boundary and kind (``llm_timeline_violations_total``), and
``analyze`` / ``compare`` say how many records were affected. A part whose ends are out of order is
not reported as 0: its value stays what it is where it can be computed, and a record whose token
events fall outside its own span keeps none (TTFT unknown, ``events_rejected``).

Across boundaries only durations are compared (a client's TTFT contains the server's, which
contains the engine's), so no clock offset between hosts is needed.
"""

from __future__ import annotations

import numpy as np

from . import walked_span as sp

NO_NS = np.iinfo(np.int64).min

#: kind -> what it means. Engine-side kinds reported by the hooks (``llm.timeline.violations`` on the
#: request span) are listed here too; the collector adds the ones it can check itself.
KINDS = {
    "token_before_arrival": "a token event earlier than the request's arrival (hooks: kept, not clamped)",
    "token_after_finish": "a token event later than the request's finish (hooks: kept, not clamped)",
    "queued_before_arrival": "the engine queued the request before its front end says it arrived",
    "phase_outside_request": "a phase (queue, prefill, decode, preemption) began or ended outside the "
    "request: the hooks clamp it into the request for trace viewers; an engine's own spans that say so "
    "(vLLM's durations, SGLang's stages) leave that phase unknown",
    "events_outside_record": "token events outside the record's span: dropped (TTFT unknown)",
    "scheduled_before_arrival": "first scheduled earlier than arrival",
    "generated_before_scheduled": "first token generated earlier than first scheduled",
    "handed_out_before_generated": "first output handed out earlier than first token generated",
    "arrival_before_server_received": "the engine's arrival earlier than the HTTP server received the request",
    "output_after_last_chunk": "an engine output handed out after the server's last body chunk",
    "server_ttft_below_engine": "the server's TTFT below the engine's (the server's interval contains the engine's)",
    "client_ttft_below_server": "the client's TTFT below the server's (the client's interval contains the server's)",
    "client_ttft_below_engine": "the client's TTFT below the engine's, without a server span",
}


def check(
    code: np.ndarray,
    submit: np.ndarray,
    first_scheduled: np.ndarray,
    first_generated: np.ndarray,
    first_event: np.ndarray,
    ttft: np.ndarray,
    output_tokens: np.ndarray,
    events_rejected: np.ndarray,
    server_received: np.ndarray,
    pairs: list[tuple[int, int]],
    server_of: list[tuple[int, int]],
    reported: list,
) -> list[str | None]:
    """The kinds each record violates. Times are Unix ns (``NO_NS`` unknown), ``ttft`` seconds (NaN
    unknown); ``pairs`` are (client, engine) and ``server_of`` (server, engine) record indices;
    ``reported`` is each record's ``llm.timeline.violations`` attribute (kinds, comma-separated;
    anything else is ignored)."""
    n = len(code)
    masks: dict[str, np.ndarray] = {}  # kind -> the records that break it

    def mark(rows: np.ndarray, kind: str) -> None:
        m = masks.get(kind)
        if m is None:
            m = masks[kind] = np.zeros(n, bool)
        m[rows] = True

    known = lambda a: a != NO_NS
    below = lambda a, b: np.isfinite(a) & np.isfinite(b) & (a < b)
    eng = code == sp.ENGINE
    mark(events_rejected > 0, "events_outside_record")
    mark(eng & known(first_scheduled) & (first_scheduled < submit), "scheduled_before_arrival")
    both = known(first_scheduled) & known(first_generated)
    mark(eng & both & (first_generated < first_scheduled), "generated_before_scheduled")
    out_first = eng & known(first_generated) & known(first_event)
    mark(out_first & (first_event < first_generated), "handed_out_before_generated")
    server_of_engine = np.full(n, -1, np.int64)
    if server_of:
        sv, ev = np.array(server_of, np.int64).T
        server_of_engine[ev] = sv
        mark(ev[known(server_received[ev]) & (submit[ev] < server_received[ev])], "arrival_before_server_received")
        mark(sv[(output_tokens[sv] < output_tokens[ev]) & (output_tokens[sv] >= 0)], "output_after_last_chunk")
        mark(sv[below(ttft[sv], ttft[ev])], "server_ttft_below_engine")
    if pairs:
        ci, ei = np.array(pairs, np.int64).T
        si = server_of_engine[ei]
        served = si >= 0
        mark(ci[served & below(ttft[ci], ttft[np.where(served, si, ei)])], "client_ttft_below_server")
        mark(ci[~served & below(ttft[ci], ttft[ei])], "client_ttft_below_engine")
    said = {i for i, r in enumerate(reported) if type(r) is str and r}  # rare: the hooks' own word
    out: list[str | None] = [None] * n
    flagged = np.zeros(n, bool)
    for m in masks.values():
        flagged |= m
    for i in sorted(set(np.flatnonzero(flagged).tolist()) | said):
        kinds = {k for k, m in masks.items() if m[i]}
        if i in said:
            kinds |= {k for k in reported[i].split(",") if k in KINDS}
        out[i] = ",".join(sorted(kinds)) or None
    return out


def tally(violations, labels=None) -> dict:
    """Records per kind over a ``violations`` column (``None`` where a record holds): ``kind ->
    records``, or with ``labels`` (one per record) ``(label, kind) -> records``."""
    out: dict = {}
    for i, v in enumerate(violations):
        if v:
            for k in v.split(","):
                key = k if labels is None else (labels[i], k)
                out[key] = out.get(key, 0) + 1
    return out
