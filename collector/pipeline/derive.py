"""Derivation: assembled traces -> one record per request and boundary, as a columnar
:class:`~collector.pipeline.records.RecordBatch`.

Named stages, each a function of what the one before it made (:func:`derive` joins them by keyword):

1. **group** (:func:`group`): the request spans of the batch (``llm.request``: engine,
   ``llm.client.request``: client, and the request spans others send, adopted by
   :mod:`~collector.pipeline.foreign_spans`), one record each, in span order;
2. **phases** (:func:`engine_phases`): each engine record's front end, queue, prefill, decode and
   preemptions from its child spans (integer ns), and its own generation times;
2b. **legs** (:func:`join_legs`): a disaggregated request's prefill leg joined to its decode leg
   (:mod:`~collector.pipeline.disagg`), and taken out of the records: one request, one record;
3. **server** (:func:`server_spans`): the HTTP server span between a client and an engine span
   (``engine_hooks.asgi``): when it read the request and every body chunk it wrote;
4. **pair** (:func:`pair_records`): which client record and which engine record are one request;
5. **server records** (:func:`with_server_records`): the server boundary's own record per engine
   record under a server span;
6. **per-boundary metrics** (:func:`token_events`, then the core's vectorised
   :func:`otel_llm.metrics.request_math.request_metrics`): TTFT, TPOT, E2E, the largest ITL;
7. **decomposition** (:func:`decompose`): the client TTFT's parts (:mod:`~collector.pipeline.ttft_parts`)
   of each pair, exactly, in integer ns: ``client_send`` + ``network_in`` + ``api_in`` +
   ``front_end`` + ``queue`` + ``prefill`` + ``api_out`` + ``network_out`` = client TTFT, with
   ``to_engine`` and ``delivery`` for the outer parts where the HTTP server span is missing;
8. **stalls** (:func:`~collector.pipeline.stalls.stall_layers`): the layers of each pair's largest gap;
9. **record batch** (:func:`record_batch`): the columns of ``records.COLUMNS``, with what a pair
   shares (sampling weight, bench run, tokens the client never read).

Python touches each span once, to pick out the request spans and find each phase's request;
the rest is numpy over the whole batch.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from otel_llm.metrics.request_math import RequestMetrics, request_metrics
from otel_llm.metrics.timeline import STATUS_CODE, clean_events
from otel_llm.semconv import PairedBy, RequestStatus

from . import disagg, foreign_spans, invariants, speculation
from . import walked_span as sp
from .adopted_spans import Adopted
from .assembly import ReleasedTrace
from .disagg import PrefillLegs
from .records import NO_NS, RecordBatch, seconds, timeline_batch
from .stalls import stall_layers
from .ttft_parts import OUTER

_NS = 1e9
_CODE, _START, _END, _SID, _PARENT = (
    operator.itemgetter(i) for i in (sp.CODE, sp.START, sp.END, sp.SPAN_ID, sp.PARENT_ID)
)
_STATUS_OK = frozenset(STATUS_CODE)


def _choice(s: tuple) -> int | None:
    """The choice index of a request span of a request with several choices (n > 1), else None."""
    c = s[sp.CHOICE]
    return c if type(c) is int else None


def _request_id(s: tuple) -> str:
    """The record's request id: the span's (else its span id), ``#k`` after it for choice k."""
    r = s[sp.REQUEST_ID]
    rid = str(r) if r and r is not sp.INVALID else s[sp.SPAN_ID].hex()
    c = _choice(s)
    return rid if c is None else f"{rid}#{c}"


def _match_trace(
    clients: list[int], engines: list[int], recs: list[tuple], spans: list[tuple]
) -> list[tuple[int, int]]:
    """Match the client and engine records (indices into ``recs``) of one trace: by ancestry (the
    engine span descends from the client span through the injected traceparent, maybe through
    spans in between, at most 64 hops; among several, the one with the client's request id, else
    with its choice index), then by request id, then by choice, then (a client span of a call with
    several choices, one span for all: a GenAI instrumentation's) the first free choice of its id,
    then one to one.

    Linear in the trace's spans: each engine span's ancestors are walked once, and the candidates
    by request id and by choice wait in queues (a trace of N clients and N engines once took
    O(N^2): 8.6 s at N = 1,600, holding the derivation lock)."""
    parent_of = {s[sp.SPAN_ID]: s[sp.PARENT_ID] for s in spans}
    client_sids = {recs[c][sp.SPAN_ID] for c in clients}
    below_of: dict[bytes, list[int]] = {}  # client span id -> the engines descending from it, in order
    by_id: dict[str, deque] = {}
    by_choice: dict[int, deque] = {}
    by_call: dict[str, list] = {}  # an engine record of a choice: its call's request id -> (choice, record)
    for e in engines:
        p, hops, seen = recs[e][sp.PARENT_ID], 0, set()
        while p and hops < 64:
            if p in client_sids and p not in seen:
                seen.add(p)
                below_of.setdefault(p, []).append(e)
            p, hops = parent_of.get(p, b""), hops + 1
        by_id.setdefault(_request_id(recs[e]), deque()).append(e)
        ch = _choice(recs[e])
        if ch is not None:
            by_choice.setdefault(ch, deque()).append(e)
            r = recs[e][sp.REQUEST_ID]
            if type(r) is str and r:
                by_call.setdefault(r, []).append((ch, e))
    by_call_q = {k: deque(e for _, e in sorted(v)) for k, v in by_call.items()}
    taken: set[int] = set()

    def first_free(queue: deque | None) -> int | None:
        while queue and queue[0] in taken:
            queue.popleft()
        return queue[0] if queue else None

    pairs = []
    for c in clients:
        rid, ch = _request_id(recs[c]), _choice(recs[c])
        below = [e for e in below_of.get(recs[c][sp.SPAN_ID], ()) if e not in taken]
        if below:
            match = next((e for e in below if _request_id(recs[e]) == rid), None)
            if match is None and ch is not None:  # n > 1: the engine's child for this choice
                match = next((e for e in below if _choice(recs[e]) == ch), None)
            if match is None:
                match = below[0]
        else:
            match = first_free(by_id.get(rid))
            if match is None and ch is not None:
                match = first_free(by_choice.get(ch))
            if match is None and ch is None:  # one span for a call of several choices: its first
                match = first_free(by_call_q.get(rid))
        if match is None and len(clients) == 1 and len(engines) == 1:
            match = engines[0]
        if match is not None:
            taken.add(match)
            pairs.append((c, match))
    return pairs


def _owners(key: dict, ids: list[bytes], tix: np.ndarray, rec_tix: np.ndarray, spans_tix) -> np.ndarray:
    """For each span id in ``ids`` (the parents of spans of traces ``tix``), the record whose span
    has that id in the same trace, else -1. Looked up by span id alone, in C (``map``), then
    checked against the trace; a span id shared across traces in the batch is resolved per trace."""
    own = np.fromiter(map(key.get, ids, repeat(-1)), np.int64, len(ids))
    found = own >= 0
    wrong = np.flatnonzero(found)[rec_tix[own[found]] != tix[found]]
    for j in wrong.tolist():  # another trace's span has that id: find this trace's own
        own[j] = spans_tix.get((int(tix[j]), ids[j]), -1)
    return own


def _server_record(engine: tuple, server: tuple, chunks: np.ndarray) -> tuple:
    """The server boundary's record of one request, as a walked span: the HTTP server span's times
    and ids, and the engine record's token events at the times the server wrote them (the first
    body chunk at or after each was handed out; events written in the same chunk are one event).
    The server reads no SSE payload, so the tokens are counted where the engine counted them."""
    row = list(engine)
    for k in (sp.CODE, sp.SPAN_ID, sp.PARENT_ID, sp.START, sp.END, sp.STATUS_CODE, sp.KIND):
        row[k] = server[k]
    row[sp.CODE] = sp.SERVER
    row[sp.GEN_OFFSETS] = row[sp.GEN_TOKENS] = None
    row[sp.SAMPLING_P] = server[sp.SAMPLING_P]  # the server span's own (else its engine's, in derive)
    ob, tb = engine[sp.OFFSETS], engine[sp.TOKENS]
    offs = toks = b""
    if type(ob) is bytes and type(tb) is bytes and len(ob) == len(tb) and len(ob) % 8 == 0 and len(ob):
        k = np.searchsorted(chunks, engine[sp.START] + np.frombuffer(ob, np.int64), side="left")
        keep = k < len(chunks)
        written = chunks[k[keep]]
        if len(written) and not np.any(np.diff(written) < 0):
            t, first = np.unique(written, return_index=True)
            offs = (t - server[sp.START]).astype(np.int64).tobytes()
            toks = np.add.reduceat(np.frombuffer(tb, np.int64)[keep], first).astype(np.int64).tobytes()
    row[sp.OFFSETS], row[sp.TOKENS] = offs, toks
    return tuple(row)


@dataclass
class RequestSpans:
    """Stage 1: the request spans of a batch of traces, one record each, in span order, and the
    spans around them (every span of the batch after adoption)."""

    recs: list[tuple]  # the request spans, as walked
    code: np.ndarray  # CLIENT / ENGINE per record
    trace: np.ndarray  # the record's trace, an index into the batch
    summarised: np.ndarray  # bool: from vLLM's own span, its token events the first and last only
    spans: list[tuple]  # every span of the batch
    span_code: np.ndarray
    span_trace: np.ndarray
    by_span_id: dict  # span id -> record
    by_trace_span: dict  # (trace, span id) -> record, where a span id is used twice in the batch
    foreign: Adopted  # what vLLM's and SGLang's own spans said of their phases

    def owners(self, ids: list[bytes], trace: np.ndarray) -> np.ndarray:
        """For each span id in ``ids`` (the parents of spans of traces ``trace``), the record whose
        span has that id in the same trace, else -1."""
        return _owners(self.by_span_id, ids, trace, self.trace, self.by_trace_span)

    def take(self, keep: np.ndarray) -> RequestSpans:
        """The same batch with only the records where ``keep`` (every span stays: a record taken
        out owns its phases no longer)."""
        recs = [r for r, k in zip(self.recs, keep.tolist()) if k]
        trace = self.trace[keep]
        key, per_trace = _span_index(recs, trace)
        return RequestSpans(
            recs, self.code[keep], trace, self.summarised[keep], self.spans, self.span_code, self.span_trace,
            key, per_trace, self.foreign,
        )  # fmt: skip


def group(traces: list[ReleasedTrace]) -> RequestSpans:
    """The request spans of ``traces``: Python touches each span once, to read its code."""
    flat = [s for t in traces for s in t.spans]
    codes = np.fromiter(map(_CODE, flat), np.int64, len(flat))
    tix = np.repeat(np.arange(len(traces)), [len(t.spans) for t in traces])
    adopted = foreign_spans.adopt(flat, codes, tix)  # vLLM's, SGLang's and GenAI clients' own spans
    at = np.flatnonzero(adopted.codes <= sp.ENGINE)
    recs = [adopted.flat[i] for i in at.tolist()]
    rec_tix = adopted.tix[at]
    return RequestSpans(
        recs,
        adopted.codes[at],
        rec_tix,
        adopted.summarised[at],
        adopted.flat,
        adopted.codes,
        adopted.tix,
        *_span_index(recs, rec_tix),
        foreign=adopted,
    )


def _span_index(recs: list[tuple], rec_tix: np.ndarray) -> tuple[dict, dict]:
    """Records by span id, and by (trace, span id) where a span id is used twice (across traces,
    or within one)."""
    sids = list(map(_SID, recs))
    key = dict(zip(sids, range(len(recs))))
    per_trace = {(t, s): r for r, (t, s) in enumerate(zip(rec_tix.tolist(), sids))} if len(key) < len(recs) else {}
    return key, per_trace


@dataclass
class EnginePhases:
    """Stage 2: each record's engine phases, in ns (int64, ``NO_NS`` unknown) unless said."""

    front_end: np.ndarray
    queue: np.ndarray
    prefill: np.ndarray
    decode: np.ndarray
    first_scheduled: np.ndarray  # Unix ns, engine clock
    first_generated: np.ndarray  # Unix ns, engine clock
    preemptions: np.ndarray  # int64, a count
    preempted: np.ndarray  # float64 ns, a sum
    generated: list  # per engine record: (Unix ns, tokens or None) of its generation events, else None

    def take(self, keep: np.ndarray) -> EnginePhases:
        """The phases of the records where ``keep``."""
        return EnginePhases(
            **{f: getattr(self, f)[keep] for f in (*_NS_PHASES, "preemptions", "preempted")},
            generated=[g for g, k in zip(self.generated, keep.tolist()) if k],
        )

    def padded(self, m: int) -> EnginePhases:
        """The same with ``m`` records appended that have no engine phases."""
        more = lambda a, v: np.concatenate([a, np.full(m, v, a.dtype)])
        return EnginePhases(
            **{f: more(getattr(self, f), NO_NS) for f in _NS_PHASES},
            preemptions=more(self.preemptions, 0),
            preempted=more(self.preempted, 0.0),
            generated=self.generated + [None] * m,
        )


_NS_PHASES = ("front_end", "queue", "prefill", "decode", "first_scheduled", "first_generated")


def engine_phases(rs: RequestSpans) -> EnginePhases:
    """The phases of each engine record from its child spans, as numpy scatters. First scheduled is
    the start of the prefill span (else the end of a complete queue span); a phase given twice: the
    later wins. What an engine's own request span said (``rs.foreign``) fills in after."""
    n = len(rs.recs)
    child = np.flatnonzero(rs.span_code > sp.ENGINE)
    kids = [rs.spans[i] for i in child.tolist()]
    own = rs.owners(list(map(_PARENT, kids)), rs.span_trace[child])
    kind = rs.span_code[child]
    ok = own >= 0
    ok[ok] = rs.code[own[ok]] == sp.ENGINE
    kstart = np.fromiter(map(_START, kids), np.int64, len(kids))
    kend = np.fromiter(map(_END, kids), np.int64, len(kids))
    dur = kend - kstart
    ph = {f: np.full(n, NO_NS, np.int64) for f in _NS_PHASES}
    at = ok & (kind == sp.FRONTEND)
    ph["front_end"][own[at]] = dur[at]
    at = ok & (kind == sp.QUEUE)
    if at.any():
        qi = np.flatnonzero(at)
        at[qi] = [not kids[j][sp.INCOMPLETE] for j in qi.tolist()]  # the engine never scheduled it
        ph["queue"][own[at]] = dur[at]
        ph["first_scheduled"][own[at]] = kend[at]
    at = ok & (kind == sp.PREFILL)
    ph["prefill"][own[at]] = dur[at]
    ph["first_scheduled"][own[at]] = kstart[at]
    ph["first_generated"][own[at]] = kend[at]
    at = ok & (kind == sp.DECODE)
    ph["decode"][own[at]] = dur[at]
    at = ok & (kind == sp.PREEMPTION)
    phases = EnginePhases(
        **ph,
        preemptions=np.bincount(own[at], minlength=n).astype(np.int64),
        preempted=np.bincount(own[at], weights=dur[at].astype(np.float64), minlength=n),
        generated=_generation_times(rs),
    )
    if rs.foreign.phases:  # what vLLM's and SGLang's own spans said (collector/pipeline/foreign_spans.py)
        for r, t_sid in enumerate(zip(rs.trace.tolist(), map(_SID, rs.recs))):
            said = rs.foreign.phases.get(t_sid)
            if said is None:
                continue
            for f in _NS_PHASES:
                v = getattr(said, f)
                if v is not None:
                    getattr(phases, f)[r] = v
            if said.generated is not None:
                phases.generated[r] = (said.generated, None)
    return phases


def _generation_times(rs: RequestSpans) -> list:
    """The engine's own generation times, apart from its token events (``llm.token_generated.*``)."""
    generated: list = [None] * len(rs.recs)
    for e in np.flatnonzero(rs.code == sp.ENGINE).tolist():
        r = rs.recs[e]
        g = r[sp.GEN_OFFSETS]
        if type(g) is bytes and g and len(g) % 8 == 0:
            k = r[sp.GEN_TOKENS]
            gt = np.frombuffer(k, np.int64) if type(k) is bytes and len(k) == len(g) else None
            generated[e] = (r[sp.START] + np.frombuffer(g, np.int64), gt)
    return generated


@dataclass
class ServerSpans:
    """Stage 3: the HTTP server span above each engine record (``engine_hooks.asgi``), where one is."""

    engine_parent: list[bytes]  # per engine record (in record order): its parent span id, past the server span
    received: np.ndarray  # per record: Unix ns, server clock, the server read the request; NO_NS unknown
    chunks: list  # per record: int64 array of the body chunks it wrote (Unix ns, sorted), or None
    span: dict[int, tuple]  # engine record -> its server span (with chunk times)

    def padded(self, m: int) -> ServerSpans:
        received = np.concatenate([self.received, np.full(m, NO_NS, np.int64)])
        return ServerSpans(self.engine_parent, received, self.chunks + [None] * m, self.span)


def server_spans(rs: RequestSpans) -> ServerSpans:
    """The server span between a client span and the engine's: the engine record gets its times,
    and pairs with the server span's parent."""
    n = len(rs.recs)
    eng = np.flatnonzero(rs.code == sp.ENGINE)
    parents = [rs.recs[e][sp.PARENT_ID] for e in eng.tolist()]
    received = np.full(n, NO_NS, np.int64)
    chunks: list = [None] * n
    span: dict[int, tuple] = {}
    srv_at = np.flatnonzero(rs.span_code == sp.SERVER)
    if len(srv_at):
        srv = {(int(rs.span_trace[i]), rs.spans[i][sp.SPAN_ID]): rs.spans[i] for i in srv_at.tolist()}
        for j, e in enumerate(eng.tolist()):
            s = srv.get((int(rs.trace[e]), parents[j]))
            if s is None:
                continue
            parents[j] = s[sp.PARENT_ID]
            received[e] = s[sp.START]
            ch = s[sp.CHUNK_OFFSETS]
            if type(ch) is bytes and len(ch) % 8 == 0:
                # sorted: chunks are written in order, and a sender that says otherwise must not
                # turn the lookups below into nonsense
                chunks[e] = np.sort(s[sp.START] + np.frombuffer(ch, np.int64))
                span[e] = s
    return ServerSpans(parents, received, chunks, span)


def pair_records(rs: RequestSpans, server: ServerSpans, traces: list[ReleasedTrace]) -> list[tuple[int, int]]:
    """Stage 4: (client record, engine record) of each request seen at both. The fast way: an
    engine request span whose parent is a client request span of its trace (or the HTTP server span
    under it); the traces where that does not pair everything it could go through the general
    matching (:func:`_match_trace`)."""
    eng = np.flatnonzero(rs.code == sp.ENGINE)
    cl = rs.owners(server.engine_parent, rs.trace[eng])
    direct = cl >= 0
    direct[direct] = rs.code[cl[direct]] == sp.CLIENT
    ci, ei = cl[direct], eng[direct]
    if len(np.unique(ci)) < len(ci):  # a client span claimed twice (n > 1): the general matching decides
        values, counts_ = np.unique(ci, return_counts=True)
        once = ~np.isin(ci, values[counts_ > 1])
        ci, ei = ci[once], ei[once]
    nt = len(traces)
    clients = np.bincount(rs.trace[rs.code == sp.CLIENT], minlength=nt)
    engines = np.bincount(rs.trace[rs.code == sp.ENGINE], minlength=nt)
    paired = np.bincount(rs.trace[ci], minlength=nt)
    redo = np.flatnonzero(paired < np.minimum(clients, engines))
    pairs = list(zip(ci.tolist(), ei.tolist()))
    if len(redo):
        redo_set = set(redo.tolist())
        rt = rs.trace.tolist()
        pairs = [(c, e) for c, e in pairs if rt[c] not in redo_set]
        # each redone trace's records, found once for the batch (a scan per trace was O(n^2): a
        # batch of 8,000 traces behind a traced proxy took 6.7 s)
        order = np.argsort(rs.trace, kind="stable")
        starts = np.searchsorted(rs.trace[order], redo)
        ends = np.searchsorted(rs.trace[order], redo, side="right")
        for t, a, b in zip(redo.tolist(), starts.tolist(), ends.tolist()):
            mine = order[a:b].tolist()
            pairs += _match_trace(
                [r for r in mine if rs.code[r] == sp.CLIENT],
                [r for r in mine if rs.code[r] == sp.ENGINE],
                rs.recs,
                traces[t].spans,
            )
    return pairs


@dataclass
class Requests:
    """Stages 1 to 5: every record of the batch (the server boundary's last), with what derivation
    reads of it."""

    recs: list[tuple]
    code: np.ndarray  # CLIENT / ENGINE / SERVER per record
    summarised: np.ndarray
    phases: EnginePhases
    server: ServerSpans
    pairs: list[tuple[int, int]]  # (client record, engine record)
    server_of: list[tuple[int, int]]  # (server record, its engine record)
    legs: PrefillLegs  # a disaggregated request's decode record: its prefill leg


def with_server_records(
    rs: RequestSpans, phases: EnginePhases, server: ServerSpans, pairs: list, legs: PrefillLegs
) -> Requests:
    """Stage 5: a record of its own for the server boundary, per engine record under a server span
    (appended after the others, with no engine phases of its own)."""
    if not server.span:
        return Requests(rs.recs, rs.code, rs.summarised, phases, server, pairs, [], legs)
    n, m = len(rs.recs), len(server.span)
    extra = [_server_record(rs.recs[e], s, server.chunks[e]) for e, s in server.span.items()]
    return Requests(
        recs=rs.recs + extra,
        code=np.concatenate([rs.code, np.full(m, sp.SERVER, rs.code.dtype)]),
        summarised=np.concatenate([rs.summarised, rs.summarised[list(server.span)]]),  # the server's copy
        phases=phases.padded(m),
        server=server.padded(m),
        pairs=pairs,
        server_of=list(zip(range(n, n + m), server.span)),
        legs=legs.padded(m),
    )


def join_legs(rs: RequestSpans, phases: EnginePhases) -> tuple[RequestSpans, EnginePhases, PrefillLegs]:
    """Stage 2b: a disaggregated request's prefill leg joined to its decode leg
    (:mod:`~collector.pipeline.disagg`) and taken out of the records: counted once, its account
    kept as the decode record's."""
    joined = disagg.join(rs.recs, rs.code, rs.trace, rs.spans, rs.span_trace)
    if not joined:
        return rs, phases, PrefillLegs.none(len(rs.recs))
    legs = disagg.legs_of(rs.recs, phases.queue, phases.prefill, joined)
    keep = np.ones(len(rs.recs), bool)
    keep[[p for _, p in joined]] = False
    return rs.take(keep), phases.take(keep), legs.take(keep)


def requests(traces: list[ReleasedTrace]) -> Requests:
    """Stages 1 to 5 over a batch of traces."""
    rs = group(traces)
    rs, phases, legs = join_legs(rs, engine_phases(rs))
    server = server_spans(rs)
    return with_server_records(rs, phases, server, pair_records(rs, server, traces), legs)


#: More tokens than this in one event is not an output chunk: the event is invalid.
MAX_EVENT_TOKENS = 1 << 31


def token_events(offsets: tuple, tokens: tuple, duration_ns: np.ndarray) -> tuple[np.ndarray, ...]:
    """Token events of every record from its int64 byte arrays, made valid where they enter
    derivation (:func:`~otel_llm.metrics.timeline.clean_events`). A record whose arrays are unusable
    (another type, mismatched lengths) keeps none; so does one with an event outside its span
    (offset < 0 or past ``duration_ns``) or with a token count outside [0, MAX_EVENT_TOKENS]: such
    events would make a negative TTFT or a negative token counter. Those records' event counts are
    returned as ``rejected``.
    Returns (event_start[n + 1], offsets, tokens, rejected[n])."""
    n = len(offsets)
    ob = [o if type(o) is bytes else b"" for o in offsets]
    tb = [k if type(k) is bytes else b"" for k in tokens]
    no = np.fromiter(map(len, ob), np.int64, n)
    nt = np.fromiter(map(len, tb), np.int64, n)
    bad = (no != nt) | (no % 8 != 0)
    if bad.any():
        for i in np.flatnonzero(bad).tolist():
            ob[i] = tb[i] = b""
        no[bad] = 0
    offs = np.frombuffer(b"".join(ob), np.int64)
    toks = np.frombuffer(b"".join(tb), np.int64)
    owner = np.repeat(np.arange(n), no // 8)
    rejected = np.zeros(n, np.int64)
    invalid = (offs < 0) | (offs > duration_ns[owner]) | (toks < 0) | (toks > MAX_EVENT_TOKENS)
    if invalid.any():
        bad_rec = np.unique(owner[invalid])
        rejected[bad_rec] = (no // 8)[bad_rec]
        keep = ~np.isin(owner, bad_rec)
        owner, offs, toks = owner[keep], offs[keep], toks[keep]
    return (*clean_events(owner, offs, toks, n), rejected)


#: the smallest sampling probability a span may claim (a weight of at most a million)
MIN_SAMPLING_P = 1e-6


def _model(m, service) -> str:
    if m and m is not sp.INVALID:
        return str(m)
    return str(service) if service and service is not sp.INVALID else "unknown"


def _models(rq: Requests, fields: list, same: dict) -> list[str]:
    """Each record's model: its span's ``gen_ai.request.model``; where the span does not say (vLLM's
    own span, without the hooks), the paired client's (what the request asked for), a server record
    its engine's; else the service name, else 'unknown'."""
    own = [same.setdefault(m, m) if type(m) is str and m else None for m in fields[sp.MODEL]] if rq.recs else []
    for c, e in rq.pairs:
        if own[e] is None:
            own[e] = own[c]
    for sv, e in rq.server_of:
        if own[sv] is None:
            own[sv] = own[e]
    return [m if m is not None else _model(None, svc) for m, svc in zip(own, fields[sp.SERVICE])]


def _status(s, code: int) -> str:
    if s in _STATUS_OK:
        return s
    return RequestStatus.ERROR if s or code == 2 else RequestStatus.OK


#: The client TTFT's parts a (client, engine) pair gives beyond the engine's own phases.
#: the outer parts computed from a pair (prefill_leg is the decode record's, :mod:`.disagg`)
PAIR_PARTS = tuple(n for n in OUTER if n not in disagg.FROM_ENGINE)


def pair_parts(
    c_submit: np.ndarray,
    c_sent: np.ndarray,
    c_first: np.ndarray,
    e_submit: np.ndarray,
    e_first_generated: np.ndarray,
    e_first_out: np.ndarray,
    received: np.ndarray,
    first_chunk: np.ndarray,
    p_arrival: np.ndarray | None = None,
    p_finish: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The outer parts of the client TTFT (:data:`PAIR_PARTS`) of (client, engine) pairs, in
    seconds, NaN where unknown. Arrays aligned by pair, times in Unix ns (``NO_NS`` unknown): the
    client's call, the moment it began writing the request and its first token (client clock); the
    engine's arrival, first token generated and first output handed out (engine clock); the HTTP
    server's first byte read and the first body chunk it wrote once the engine had a token out
    (server clock). Parts across two clocks are uncorrected (:mod:`collector.analysis.compare` corrects
    them); without a send time, ``network_in`` starts at the call. ``p_arrival``, ``p_finish``: a
    disaggregated request's prefill leg, its arrival and finish (prefill engine clock; ``NO_NS``
    for another request): its way to the decode server went through a proxy and the whole prefill
    leg, not network, so no ``network_in``; ``to_prefill`` and ``pd_hop`` instead."""
    k = len(c_submit)
    out = {name: np.full(k, np.nan) for name in PAIR_PARTS}
    out["to_engine"][:] = (e_submit - c_submit) / _NS
    said = c_sent != NO_NS
    out["client_send"][said] = (c_sent[said] - c_submit[said]) / _NS
    sent = np.where(said, c_sent, c_submit)
    srv = received != NO_NS
    out["network_in"][srv] = (received[srv] - sent[srv]) / _NS
    out["api_in"][srv] = (e_submit[srv] - received[srv]) / _NS
    if p_arrival is not None and p_finish is not None:
        leg = (p_arrival != NO_NS) & (p_finish != NO_NS)
        out["network_in"][leg] = np.nan
        out["to_prefill"][leg] = (p_arrival[leg] - c_submit[leg]) / _NS
        out["pd_hop"][leg] = (e_submit[leg] - p_finish[leg]) / _NS
    engine_first = np.where(e_first_generated != NO_NS, e_first_generated, e_first_out)
    ok = (c_first != NO_NS) & (engine_first != NO_NS)
    out["delivery"][ok] = (c_first[ok] - engine_first[ok]) / _NS
    chunk = ok & (first_chunk != NO_NS)
    out["api_out"][chunk] = (first_chunk[chunk] - engine_first[chunk]) / _NS
    out["network_out"][chunk] = (c_first[chunk] - first_chunk[chunk]) / _NS
    return out


@dataclass
class TokenEvents:
    """Every record's token events, valid (:func:`token_events`), and its span's times (Unix ns)."""

    submit: np.ndarray
    end: np.ndarray
    start: np.ndarray  # record i's events are [start[i], start[i + 1])
    offsets: np.ndarray  # ns after submit
    tokens: np.ndarray
    rejected: np.ndarray  # per record: events dropped as invalid
    has: np.ndarray = field(init=False)  # per record: at least one event
    first_ns: np.ndarray = field(init=False)  # Unix ns of each record's first token event, NO_NS without one

    def __post_init__(self) -> None:
        self.has = has = np.diff(self.start) > 0
        self.first_ns = np.full(len(self.submit), NO_NS, np.int64)
        self.first_ns[has] = self.submit[has] + self.offsets[self.start[:-1][has]]


def boundary_metrics(
    fields: list,
    events: TokenEvents,
    request_id: list[str],
    status: list[str],
    input_tokens: np.ndarray,
    summarised: np.ndarray,
) -> RequestMetrics:
    """Stage 6: each record's TTFT, TPOT, E2E and largest ITL at its own boundary (and the pooled
    ITL samples, for the exporters). A response not streamed has no token events: its tokens are its
    usage, observed at its end."""
    n = len(request_id)
    usage = np.fromiter(
        (v if type(v) is int and 0 <= v < MAX_EVENT_TOKENS else -1 for v in fields[sp.OUTPUT_TOKENS]), np.int64, n
    )
    untimed = np.where(events.has, 0, np.maximum(usage, 0))
    # a span that summarises its tokens (a GenAI client's, vLLM's own) and says no count: unknown
    unknown = summarised & (usage < 0)
    return request_metrics(
        timeline_batch(
            request_id, events.submit, events.end, status, events.start, events.offsets, events.tokens,
            input_tokens, untimed_tokens=untimed, summarised=summarised, tokens_unknown=unknown,
        )
    )  # fmt: skip


#: The engine's columns a paired client record takes from its engine record (the P/D columns:
#: disagg.FROM_ENGINE, copied once they are made).
FROM_ENGINE = (
    "front_end_queue", "front_end", "queue", "kv_transfer", "kv_ready", "kv_blocks", "kv_bytes", "kv_wire",
    "kv_handshake", "prefill", "decode", "preemptions", "preemption_time", "engine_delivery", "first_scheduled_ns",
    "first_generated_ns", "server_received_ns", "server_first_chunk_ns",
)  # fmt: skip


def decompose(rq: Requests, fields: list, events: TokenEvents) -> dict[str, np.ndarray]:
    """Stage 7: the engine phases of every record in ``records.COLUMNS``' units (seconds, NaN
    unknown; Unix ns, ``NO_NS`` unknown), the server's first chunk once the engine had a token out,
    and the client TTFT's outer parts of each pair (:func:`pair_parts`); a paired client record takes
    its engine record's engine columns. Keyed by column name."""
    n = len(rq.recs)
    ph, server = rq.phases, rq.server
    has, first_event = events.has, events.first_ns
    engine_delivery = np.full(n, np.nan)
    at = has & (ph.first_generated != NO_NS)
    engine_delivery[at] = (first_event[at] - ph.first_generated[at]) / _NS
    server_first = np.full(n, NO_NS, np.int64)
    for e in np.flatnonzero(
        server.received != NO_NS
    ).tolist():  # the first chunk written once the engine had a token out
        ch = server.chunks[e]
        if ch is not None and has[e] and len(ch):
            k = int(np.searchsorted(ch, first_event[e], side="left"))
            if k < len(ch):
                server_first[e] = ch[k]
    # an engine span of another source (vLLM's own, SGLang's) has no preemption spans: not 0, unknown
    foreign = (rq.code == sp.ENGINE) & (
        rq.summarised | np.fromiter((type(v) is str for v in fields[sp.SGLANG_RID]), bool, n)
    )
    # vLLM's own span: the queue's and the prefill's lengths, not where they start; what its TTFT holds
    # besides the prefill is one part (front end, queue, the first token's hand-off), so that the
    # parts sum to the TTFT exactly
    merged = foreign & has & (ph.front_end == NO_NS) & (ph.first_scheduled == NO_NS) & (ph.prefill != NO_NS)
    front_end_queue = np.full(n, np.nan)
    front_end_queue[merged] = (first_event[merged] - events.submit[merged] - ph.prefill[merged]) / _NS
    out = {
        "front_end_queue": front_end_queue,
        "front_end": seconds(ph.front_end),
        "queue": seconds(ph.queue),
        "kv_transfer": np.full(n, np.nan),  # a decode engine's KV fetch: its account joins later
        "kv_ready": np.full(n, np.nan),  # (collector/pipeline/kv_fetch.py)
        "kv_blocks": np.full(n, -1, np.int64),
        "kv_bytes": np.full(n, -1, np.int64),
        "kv_load": [None] * n,
        "kv_wire": np.full(n, np.nan),
        "kv_handshake": np.full(n, np.nan),
        "prefill": seconds(ph.prefill),
        "decode": seconds(ph.decode),
        "preemptions": np.where(foreign, -1, ph.preemptions),
        "preemption_time": np.where(foreign, np.nan, ph.preempted / _NS),
        "first_scheduled_ns": ph.first_scheduled,
        "first_generated_ns": ph.first_generated,
        "engine_delivery": engine_delivery,
        **{name: np.full(n, np.nan) for name in PAIR_PARTS},
        "server_received_ns": server.received,
        "server_first_chunk_ns": server_first,
    }
    if rq.pairs:
        ci, ei = np.array(rq.pairs, np.int64).T
        submit, end = events.submit, events.end
        off = np.fromiter((v if type(v) is int else -1 for v in fields[sp.SEND_OFFSET]), np.int64, n)
        sent = np.where((off >= 0) & (off <= end - submit), submit + off, NO_NS)
        for name, v in pair_parts(
            submit[ci], sent[ci], first_event[ci], submit[ei], ph.first_generated[ei], first_event[ei],
            server.received[ei], server_first[ei], rq.legs.arrival[ei], rq.legs.finish()[ei],
        ).items():  # fmt: skip
            out[name][ci] = v
        for name in FROM_ENGINE:
            out[name][ci] = out[name][ei]
        out["queue"][ci[merged[ei]]] = np.nan  # in the client's parts, front_end_queue holds it
    return out


def sample_weights(fields: list, pairs: list[tuple[int, int]], server_of: list[tuple[int, int]]) -> np.ndarray:
    """Each record counts for 1 / the probability it was kept with; an engine or server record whose
    own span does not say takes its client's (the sampler decided there), else each other's. Below
    :data:`MIN_SAMPLING_P` a probability is not taken (a sender could make one span count for 1e300)."""
    prob = np.fromiter(
        (float(v) if type(v) in (float, int) and MIN_SAMPLING_P <= v <= 1 else np.nan for v in fields[sp.SAMPLING_P]),
        np.float64,
        len(fields[sp.SAMPLING_P]),
    )
    for c, e in pairs:
        if prob[e] != prob[e]:
            prob[e] = prob[c]
    for sv, e in server_of:
        if prob[e] != prob[e]:
            prob[e] = prob[sv]
        if prob[sv] != prob[sv]:
            prob[sv] = prob[e]
    return np.where(np.isfinite(prob), 1.0 / prob, 1.0)


def derive(traces: Iterable[ReleasedTrace]) -> tuple[RecordBatch, RequestMetrics]:
    """Records of every request span in ``traces``, with their per-request metrics (the pooled
    ITL samples too, for the exporters): the stages of this module, in order."""
    rq = requests(traces if isinstance(traces, list) else list(traces))
    n = len(rq.recs)
    fields = list(zip(*rq.recs)) if n else [()] * sp.WIDTH  # the walked spans' fields, as columns
    submit = np.array(fields[sp.START], np.int64)
    end = np.array(fields[sp.END], np.int64)
    events = TokenEvents(submit, end, *token_events(fields[sp.OFFSETS], fields[sp.TOKENS], end - submit))
    same: dict = {}  # one object per distinct value (each span brings its own copy): less to hold, pickle, compare
    status = [
        same.setdefault(x, x) if x in _STATUS_OK else _status(x, c)
        for x, c in zip(fields[sp.STATUS], fields[sp.STATUS_CODE])
    ]
    request_id = [
        r if type(r) is str and r and c is None else _request_id(s)
        for r, c, s in zip(fields[sp.REQUEST_ID], fields[sp.CHOICE], rq.recs)
    ]
    if rq.pairs and disagg.PREFILL in set(fields[sp.PD_ROLE]):  # a prefill leg alone: see its client
        disagg.stranded_legs_fail(status, rq.recs, rq.pairs)
    input_tokens = np.array([v if type(v) is int else -1 for v in fields[sp.INPUT_TOKENS]], np.int64)
    metrics = boundary_metrics(fields, events, request_id, status, input_tokens, rq.summarised)
    columns = decompose(rq, fields, events)
    stall_core, stall_server = np.full(n, np.nan), np.full(n, np.nan)
    if rq.pairs:
        ci, ei = np.array(rq.pairs, np.int64).T
        stall_core, stall_server = stall_layers(
            ci, ei, submit, events.start, events.offsets, events.tokens, rq.phases.generated, rq.server.chunks
        )
    columns.update(stall_core_gap=stall_core, stall_server_gap=stall_server, input_tokens=input_tokens)
    pd = disagg.columns(rq.recs, rq.code, rq.legs)
    columns.update(pd)
    if rq.pairs and pd["pd_role"].count(None) < n:  # P/D engines: the client's record says what its engine's does
        for c, e in rq.pairs:
            for name in disagg.FROM_ENGINE:
                columns[name][c] = columns[name][e]
    return record_batch(rq, fields, events, metrics, columns, status, request_id, same), metrics


def _callers(rq: Requests, fields: list) -> list[str | None]:
    """Each record's own caller, hex (before pairing): a client's parent span; an engine record's
    parent past its HTTP server span; a server record's parent."""
    caller = [p.hex() if type(p) is bytes and p else None for p in fields[sp.PARENT_ID]] if rq.recs else []
    for e, p in zip(np.flatnonzero(rq.code == sp.ENGINE).tolist(), rq.server.engine_parent):
        caller[e] = p.hex() if p else None
    return caller


def _unread_and_paired(rq: Requests, metrics: RequestMetrics, status: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per record: the tokens its client never read (a cancelled pair: the engine's output less
    the client's; -1 elsewhere), and whether it is paired."""
    n = len(rq.recs)
    unread = np.full(n, -1, np.int64)
    paired = np.zeros(n, bool)
    if rq.pairs:
        ci, ei = np.array(rq.pairs, np.int64).T
        paired[ci] = paired[ei] = True
        gone = np.fromiter((status[c] == RequestStatus.CANCELLED for c in ci.tolist()), bool, len(ci))
        lost = np.maximum(metrics.output_tokens[ei] - metrics.output_tokens[ci], 0)
        gone &= (metrics.output_tokens[ei] >= 0) & (metrics.output_tokens[ci] >= 0)  # a count unknown: unread too
        unread[ci[gone]] = unread[ei[gone]] = lost[gone]
    return unread, paired


def _shared_by_pairs(rq: Requests, fields: list, request_id: list[str], same: dict) -> tuple:
    """What the boundaries of one request share: each other's request id (peer), how they were
    paired (``trace``: one trace holds both; ``id``: a GenAI client span taken into its engine's
    trace by its response id, :mod:`~collector.pipeline.assembly`), the caller (the application's
    span the call ran under), the bench run and whether it was a warm-up, the client's given to its
    engine and the engine's to its server record."""
    n = len(rq.recs)
    peer: list = [None] * n
    paired_by: list = [None] * n
    trace_of = fields[sp.TRACE_ID]
    caller = _callers(rq, fields)
    run_id = [same.setdefault(v, v) if type(v) is str and v else None for v in fields[sp.RUN_ID]]
    warmup = np.fromiter((v is True for v in fields[sp.WARMUP]), bool, n)
    for c, e in rq.pairs:
        peer[c], peer[e] = request_id[e], request_id[c]
        paired_by[c] = paired_by[e] = PairedBy.TRACE if trace_of[c] == trace_of[e] else PairedBy.ID
        caller[e] = caller[c]  # the application's span the call ran under, at every boundary
        if run_id[e] is None:  # the engine does not know the bench run: its client does
            run_id[e] = run_id[c]
        warmup[e] |= warmup[c]
    for sv, e in rq.server_of:  # the server boundary belongs to the same run
        caller[sv] = caller[e]
        run_id[sv] = run_id[e]
        warmup[sv] = warmup[e]
    return peer, paired_by, caller, run_id, warmup


def record_batch(
    rq: Requests,
    fields: list,
    events: TokenEvents,
    metrics: RequestMetrics,
    columns: dict[str, np.ndarray],
    status: list[str],
    request_id: list[str],
    same: dict,
) -> RecordBatch:
    """Stage 9: the columns of ``records.COLUMNS`` for every record: the span's own, the earlier
    stages' (``columns``: by name), what a pair shares (the client's bench run, the tokens its
    client never read, each other's request id), the sampling weight and the timeline's violations."""
    n = len(rq.recs)
    unread, paired = _unread_and_paired(rq, metrics, status)
    peer, paired_by, caller, run_id, warmup = _shared_by_pairs(rq, fields, request_id, same)
    violations = invariants.check(
        rq.code,
        events.submit,
        columns["first_scheduled_ns"],
        columns["first_generated_ns"],
        events.first_ns,
        metrics.ttft,
        metrics.output_tokens,
        events.rejected,
        columns["server_received_ns"],
        rq.pairs,
        rq.server_of,
        fields[sp.VIOLATIONS] if n else [],
    )
    batch = RecordBatch(
        trace_id=[same.setdefault(t, t.hex()) for t in fields[sp.TRACE_ID]],
        caller_span_id=caller,
        boundary=[sp.BOUNDARY_OF[c] for c in fields[sp.CODE]],
        request_id=request_id,
        model=_models(rq, fields, same),
        service=[same.setdefault(v, v) if type(v) is str and v else None for v in fields[sp.SERVICE]],
        status=status,
        run_id=run_id,
        warmup=warmup,
        choice=np.fromiter((c if type(c) is int else -1 for c in fields[sp.CHOICE]), np.int64, n),
        events_rejected=events.rejected,
        violations=violations,
        submit_ns=events.submit,
        end_ns=events.end,
        event_start=events.start,
        event_offsets_ns=events.offsets,
        event_tokens=events.tokens,
        output_tokens=metrics.output_tokens,
        estimated_tokens=np.array([bool(e) and e is not sp.INVALID for e in fields[sp.ESTIMATED]], bool),
        events_summarised=rq.summarised,
        ttft=metrics.ttft,
        tpot=metrics.tpot,
        e2e=metrics.e2e,
        itl_max=metrics.itl_max,
        **columns,
        tokens_unread=unread,
        tokens_after_abort=np.fromiter(
            (v if type(v) is int and 0 <= v < 2**62 else -1 for v in fields[sp.AFTER_ABORT]), np.int64, n
        ),
        sample_weight=sample_weights(fields, rq.pairs, rq.server_of),
        paired=paired,
        paired_by=paired_by,
        peer_request_id=peer,
        internal_id=[
            v if type(v) is str and v and c == sp.ENGINE else None for v, c in zip(fields[sp.INTERNAL_ID], rq.code)
        ],
        # a client's from its server's response; an engine record's where its account joins
        # (speculation.SpeculationIndex)
        **speculation.own_columns(fields, n),
    )
    if rq.pairs:
        batch.pairs = tuple(np.array(rq.pairs, np.int64).T)
    return batch
