"""Disaggregated prefill and decode: the two legs of one request joined into one record.

A P/D deployment serves one client request on two engines: a prefill engine computes the prompt
(and gives one token, which the proxy discards), its KV cache moves to a decode engine, and the
decode engine generates what the client receives. Both engines' ``llm.request`` spans say their leg
(``llm.pd.role``, :mod:`engine_hooks.vllm.disagg`), and the decode leg names its prefill leg: the
prefill engine's request id and engine id (``llm.pd.peer.*``). Where a proxy carries the client's
trace context to both (``engine_hooks.trace_proxy``, ``examples/pd_proxy.py``), both legs are in
the client's trace.

:func:`join` pairs them by trace and by those ids, never by time; derivation
(:func:`collector.pipeline.derive.join_legs`) takes each joined prefill leg out of the request
records (a request is counted once: at the client, and at the decode engine, which delivers its
tokens) and keeps what it said (:class:`PrefillLegs`) as the decode record's ``prefill_leg*``
columns. A leg whose other leg was not seen stays a record of its
own, its role saying which leg it is.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields

import numpy as np

from otel_llm.semconv import PdRole, RequestStatus

from . import walked_span as sp
from .records import NO_NS, seconds

PREFILL, DECODE, BOTH = PdRole.PREFILL, PdRole.DECODE, PdRole.BOTH
JOINED = "disaggregated"  # a record's pd_role: both legs joined
_ROLE = operator.itemgetter(sp.PD_ROLE)


def _text(v) -> str | None:
    return v if type(v) is str and v else None


def join(
    recs: list[tuple],
    code: np.ndarray,
    trace: np.ndarray,
    spans: list[tuple] | None = None,
    span_trace: np.ndarray | None = None,
) -> list[tuple[int, int]]:
    """(decode record, prefill record) of each request whose two legs are both in ``recs``: the
    decode leg's peer request id and engine id are the prefill leg's internal id and engine id, in
    the same trace. Each prefill leg joins one decode leg at most. A connector that names no peer
    (the disk connector: the prefill engine answers no ``kv_transfer_params``, so the decode leg
    says ``both``) is joined by the trace's shape instead, with ``spans`` (every span of the batch,
    ``span_trace`` their traces): the one prefill leg and the one other engine leg under the same
    proxy span (each under its HTTP server span, both under the proxy's)."""
    roles = set(map(_ROLE, recs))  # iterated in C: most batches hold no P/D engine
    if PREFILL not in roles:
        return []
    if DECODE not in roles:
        return _join_by_proxy(recs, code, trace, spans, span_trace, []) if BOTH in roles else []
    prefill: dict[tuple, int] = {}
    for r, s in enumerate(recs):
        if s[sp.PD_ROLE] == PREFILL and code[r] == sp.ENGINE:
            rid = _text(s[sp.INTERNAL_ID]) or _text(s[sp.REQUEST_ID])
            if rid is not None:
                prefill.setdefault((int(trace[r]), rid, _text(s[sp.PD_ENGINE_ID])), r)
    joined = []
    for r, s in enumerate(recs):
        if s[sp.PD_ROLE] != DECODE or code[r] != sp.ENGINE:
            continue
        peer = _text(s[sp.PD_PEER_REQUEST_ID])
        if peer is None:
            continue
        p = prefill.pop((int(trace[r]), peer, _text(s[sp.PD_PEER_ENGINE_ID])), None)
        if p is not None:
            joined.append((r, p))
    return _join_by_proxy(recs, code, trace, spans, span_trace, joined) if BOTH in roles else joined


def _join_by_proxy(recs, code, trace, spans, span_trace, joined: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``joined`` and the legs joined by the trace's shape (:func:`join`): for each proxy span with
    exactly one prefill leg not joined yet and one ``both`` leg under it, that pair."""
    if spans is None or span_trace is None:
        return joined
    taken = {i for pair in joined for i in pair}
    legs = [
        r for r, s in enumerate(recs)
        if code[r] == sp.ENGINE and r not in taken and s[sp.PD_ROLE] in (PREFILL, BOTH) and s[sp.PARENT_ID]
    ]  # fmt: skip
    if not legs:
        return joined
    wanted = {(int(trace[r]), recs[r][sp.PARENT_ID]) for r in legs}
    proxy_of = {  # (trace, an engine leg's HTTP server span) -> that span's parent: the proxy's span
        (int(t), x[sp.SPAN_ID]): x[sp.PARENT_ID]
        for x, t in zip(spans, span_trace.tolist())
        if x[sp.CODE] == sp.SERVER and (int(t), x[sp.SPAN_ID]) in wanted and x[sp.PARENT_ID]
    }
    under: dict[tuple, dict[str, list[int]]] = {}
    for r in legs:
        t = int(trace[r])
        proxy = proxy_of.get((t, recs[r][sp.PARENT_ID]))
        if proxy is not None:
            under.setdefault((t, proxy), {}).setdefault(recs[r][sp.PD_ROLE], []).append(r)
    out = list(joined)
    for by_role in under.values():
        p, d = by_role.get(PREFILL, ()), by_role.get(BOTH, ())
        if len(p) == 1 and len(d) == 1:
            out.append((d[0], p[0]))
    return out


@dataclass
class PrefillLegs:
    """Per record (the prefill legs taken out): what its joined prefill leg said. Durations in ns
    (int64, ``NO_NS`` unknown), on the prefill engine's clock."""

    joined: np.ndarray  # bool: this record has a prefill leg
    engine_id: list  # the prefill leg's llm.pd.engine_id
    request_id: list  # the prefill engine's own id for the request
    arrival: np.ndarray  # its arrival, Unix ns on its clock
    leg: np.ndarray  # its arrival -> its finish
    queue: np.ndarray  # its llm.queue
    prefill: np.ndarray  # its llm.prefill
    tokens: np.ndarray  # tokens it generated (-1 unknown)

    def finish(self) -> np.ndarray:
        """Each leg's finish, Unix ns on its engine's clock (``NO_NS`` unknown)."""
        known = (self.arrival != NO_NS) & (self.leg != NO_NS)
        return np.where(known, self.arrival + np.where(known, self.leg, 0), NO_NS)

    @classmethod
    def none(cls, n: int) -> PrefillLegs:
        ns = lambda: np.full(n, NO_NS, np.int64)
        return cls(np.zeros(n, bool), [None] * n, [None] * n, ns(), ns(), ns(), ns(), np.full(n, -1, np.int64))

    def take(self, keep: np.ndarray) -> PrefillLegs:
        """The legs of the records where ``keep``."""
        out = {}
        for f in fields(self):
            a = getattr(self, f.name)
            out[f.name] = [v for v, k in zip(a, keep.tolist()) if k] if isinstance(a, list) else a[keep]
        return PrefillLegs(**out)

    def padded(self, m: int) -> PrefillLegs:
        """The same with ``m`` records appended that have no prefill leg."""
        more = PrefillLegs.none(m)
        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(more, f.name)
            out[f.name] = a + b if isinstance(a, list) else np.concatenate([a, b])
        return PrefillLegs(**out)


def _tokens(s: tuple) -> int:
    """The tokens of a record's token events (its output), -1 where it says none."""
    t = s[sp.TOKENS]
    if type(t) is bytes and t and len(t) % 8 == 0:
        return int(np.frombuffer(t, np.int64).sum())
    o = s[sp.OUTPUT_TOKENS]
    return o if type(o) is int and o >= 0 else -1


def legs_of(recs: list[tuple], queue: np.ndarray, prefill: np.ndarray, joined: list[tuple[int, int]]) -> PrefillLegs:
    """For each record, its joined prefill leg's account (``queue``, ``prefill``: every record's
    engine phases in ns, the prefill legs' among them)."""
    out = PrefillLegs.none(len(recs))
    for d, p in joined:
        s = recs[p]
        out.joined[d] = True
        out.engine_id[d] = _text(s[sp.PD_ENGINE_ID])
        out.request_id[d] = _text(s[sp.INTERNAL_ID]) or _text(s[sp.REQUEST_ID])
        out.arrival[d] = s[sp.START]
        out.leg[d] = s[sp.END] - s[sp.START]
        out.queue[d] = queue[p]
        out.prefill[d] = prefill[p]
        out.tokens[d] = _tokens(s)
    return out


def columns(recs: list[tuple], code: np.ndarray, legs: PrefillLegs) -> dict[str, object]:
    """The ``pd_*`` and ``prefill_leg*`` columns of every record (``records.COLUMNS``): a joined
    record's role is ``disaggregated``, an engine record's its own leg, others' None."""
    n = len(recs)
    role: list = [None] * n
    connector: list = [None] * n
    if n and set(map(_ROLE, recs)) != {None}:
        for r, s in enumerate(recs):
            if code[r] == sp.ENGINE:
                role[r] = _text(s[sp.PD_ROLE])
                connector[r] = _text(s[sp.PD_CONNECTOR])
    for r in np.flatnonzero(legs.joined).tolist():
        role[r] = JOINED
    return {
        "pd_role": role,
        "pd_connector": connector,
        "prefill_engine_id": legs.engine_id,
        "prefill_request_id": legs.request_id,
        "prefill_arrival_ns": legs.arrival,
        "prefill_leg": seconds(legs.leg),
        "prefill_leg_queue": seconds(legs.queue),
        "prefill_leg_prefill": seconds(legs.prefill),
        "prefill_leg_tokens": legs.tokens,
        "prefill_kv_hold": np.full(n, np.nan),  # the prefill engine's account joins later (kv_fetch.py)
    }


def stranded_legs_fail(status: list[str], recs: list[tuple], pairs: list[tuple[int, int]]) -> None:
    """A prefill leg whose decode leg never came (the decode server down, the transfer failed) did
    not serve its request: where its client says the request failed, the leg's status is the
    client's, never ``ok`` (in place). Without a client, or with a client that got its tokens (a
    decode server that is not traced), the leg keeps its own."""
    for c, e in pairs:
        if recs[e][sp.PD_ROLE] == PREFILL and status[c] != RequestStatus.OK:
            status[e] = status[c]


#: the columns a paired client record takes from its engine record
FROM_ENGINE = (
    "pd_role", "pd_connector", "prefill_engine_id", "prefill_request_id", "prefill_arrival_ns", "prefill_leg",
    "prefill_leg_queue", "prefill_leg_prefill", "prefill_leg_tokens", "prefill_kv_hold",
)  # fmt: skip
