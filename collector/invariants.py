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
    "phase_outside_request": "a phase span (queue, prefill, decode, preemption) began or ended outside the "
    "request; clamped into it for trace viewers",
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
    kinds: list[list[str]] = [[] for _ in range(n)]

    def mark(mask: np.ndarray, kind: str) -> None:
        for i in np.flatnonzero(mask).tolist():
            kinds[i].append(kind)

    for i, r in enumerate(reported):
        if type(r) is str:
            kinds[i].extend(k for k in r.split(",") if k in KINDS)
    known = lambda a: a != NO_NS
    eng = code == sp.ENGINE
    mark(events_rejected > 0, "events_outside_record")
    mark(eng & known(first_scheduled) & (first_scheduled < submit), "scheduled_before_arrival")
    both = known(first_scheduled) & known(first_generated)
    mark(eng & both & (first_generated < first_scheduled), "generated_before_scheduled")
    mark(
        eng & known(first_generated) & known(first_event) & (first_event < first_generated),
        "handed_out_before_generated",
    )
    below = lambda a, b: np.isfinite(a) & np.isfinite(b) & (a < b)
    server_for = {e: s for s, e in server_of}
    if server_of:
        sv, ev = np.array(server_of, np.int64).T
        mark_at = np.zeros(n, bool)
        late = known(server_received[ev]) & (submit[ev] < server_received[ev])
        mark_at[ev[late]] = True
        mark(mark_at, "arrival_before_server_received")
        mark_at[:] = False
        mark_at[sv[output_tokens[sv] < output_tokens[ev]]] = True
        mark(mark_at, "output_after_last_chunk")
        mark_at[:] = False
        mark_at[sv[below(ttft[sv], ttft[ev])]] = True
        mark(mark_at, "server_ttft_below_engine")
    for c, e in pairs:
        s = server_for.get(e)
        if s is not None:
            if below(ttft[c], ttft[s]):
                kinds[c].append("client_ttft_below_server")
        elif below(ttft[c], ttft[e]):
            kinds[c].append("client_ttft_below_engine")
    return [",".join(sorted(set(k))) if k else None for k in kinds]


def counts(boundary: list[str], violations: list) -> dict[tuple[str, str], int]:
    """(boundary, kind) -> records, over a batch's ``violations`` column."""
    out: dict[tuple[str, str], int] = {}
    for b, v in zip(boundary, violations):
        if v:
            for k in v.split(","):
                out[(b, k)] = out.get((b, k), 0) + 1
    return out
