"""Derivation: assembled traces -> one record per request and boundary, as a columnar
:class:`~collector.pipeline.records.RecordBatch`.

Per request span (``llm.request``: engine, ``llm.client.request``: client): submit and end from
the span, token events from ``llm.token_event.offsets_ns`` / ``.tokens`` (int64 bytes from the
walk, joined and read for the whole batch at once); engine phases from its child spans (queue,
prefill, decode, preemptions). Per-request metrics (TTFT, TPOT, E2E, largest ITL) come from the
core's vectorised :func:`otel_llm.metrics.request_math.request_metrics`, one call per batch.

When a trace holds both boundaries of a request, the client TTFT is decomposed exactly, in
integer ns: ``client_send`` (the client's call -> it began writing the request, where the client
says) + ``network_in`` (-> the HTTP server read the first bytes) + ``api_in`` (-> engine arrival) +
``front_end`` + ``queue`` + ``prefill`` (to the engine's first token *generated*) + ``api_out`` (->
the server's first chunk after it) + ``network_out`` (-> the client's first token) = client TTFT.
Without the HTTP server span, ``to_engine`` and ``delivery`` stand for the outer parts; without the
engine's phases (vLLM stats off), ``delivery`` runs from the engine's first output handed out, and
``queue``/``prefill`` are unknown.

Python touches each span once, to pick out the request spans and find each phase's request;
the rest is numpy over the whole batch.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from otel_llm.metrics.request_math import RequestMetrics, request_metrics
from otel_llm.metrics.timeline import STATUS_CODE, clean_events

from . import foreign_spans, invariants
from . import walked_span as sp
from .assembly import ReleasedTrace
from .records import NO_NS, RecordBatch, timeline_batch
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


def _pair(clients: list[int], engines: list[int], recs: list[tuple], spans: list[tuple]) -> list[tuple[int, int]]:
    """Match the client and engine records (indices into ``recs``) of one trace: by ancestry (the
    engine span descends from the client span through the injected traceparent, maybe through
    spans in between, at most 64 hops; among several, the one with the client's request id, else
    with its choice index), then by request id, then by choice, then one to one.

    Linear in the trace's spans: each engine span's ancestors are walked once, and the candidates
    by request id and by choice wait in queues (a trace of N clients and N engines once took
    O(N^2): 8.6 s at N = 1,600, holding the derivation lock)."""
    parent_of = {s[sp.SPAN_ID]: s[sp.PARENT_ID] for s in spans}
    client_sids = {recs[c][sp.SPAN_ID] for c in clients}
    below_of: dict[bytes, list[int]] = {}  # client span id -> the engines descending from it, in order
    by_id: dict[str, deque] = {}
    by_choice: dict[int, deque] = {}
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
        if match is None and len(clients) == 1 and len(engines) == 1:
            match = engines[0]
        if match is not None:
            taken.add(match)
            pairs.append((c, match))
    return pairs


@dataclass
class _Requests:
    """The request spans of a batch of traces (in span order) with their engine phases."""

    recs: list[tuple]
    code: np.ndarray  # CLIENT / ENGINE per record
    front_end_ns: np.ndarray  # int64, NO_NS unknown
    queue_ns: np.ndarray  # int64, NO_NS unknown
    prefill_ns: np.ndarray
    decode_ns: np.ndarray
    preemptions: np.ndarray  # int64
    preempted_ns: np.ndarray  # float64 (a sum)
    first_scheduled_ns: np.ndarray
    first_generated_ns: np.ndarray
    pairs: list[tuple[int, int]]  # (client record, engine record)
    server_received_ns: np.ndarray  # per record (engine records under an HTTP server span), NO_NS unknown
    server_chunks: list  # per record: int64 array of the server's body chunks (Unix ns), or None
    generated: list  # per engine record: (Unix ns, tokens) int64 arrays of its generation events, or None
    server_of: list[tuple[int, int]]  # (server record, its engine record)
    summarised: np.ndarray  # bool per record: from vLLM's own span, its token events the first and last only


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


def _requests(traces: list[ReleasedTrace]) -> _Requests:
    """Request spans, their phases and pairs, for the whole batch at once: Python touches each
    span once (to pick it out); phase values are numpy scatters. First scheduled is the start of
    the prefill span (else the end of a complete queue span); a phase given twice: the later wins."""
    flat = [s for t in traces for s in t.spans]
    codes = np.fromiter(map(_CODE, flat), np.int64, len(flat))
    tix = np.repeat(np.arange(len(traces)), [len(t.spans) for t in traces])
    adopted = foreign_spans.adopt(flat, codes, tix)  # vLLM's, SGLang's and GenAI clients' own spans
    flat, codes, tix = adopted.flat, adopted.codes, adopted.tix
    is_root = codes <= sp.ENGINE
    at = np.flatnonzero(is_root)
    recs = [flat[i] for i in at.tolist()]
    n = len(recs)
    code, rec_tix, summarised = codes[at], tix[at], adopted.summarised[at]
    sids = list(map(_SID, recs))
    key = dict(zip(sids, range(n)))
    if len(key) < n:  # a span id used twice (across traces, or within one): a key per trace too
        per_trace = {(t, s): r for r, (t, s) in enumerate(zip(rec_tix.tolist(), sids))}
    else:
        per_trace = {}
    # phases: child spans of engine request spans
    kids = [flat[i] for i in np.flatnonzero(~is_root).tolist()]
    own = _owners(key, list(map(_PARENT, kids)), tix[~is_root], rec_tix, per_trace)
    kc = codes[~is_root]
    ok = own >= 0
    ok[ok] = code[own[ok]] == sp.ENGINE
    kstart = np.fromiter(map(_START, kids), np.int64, len(kids))
    kend = np.fromiter(map(_END, kids), np.int64, len(kids))
    dur = kend - kstart
    front_end, queue, prefill, decode = (np.full(n, NO_NS, np.int64) for _ in range(4))
    m = ok & (kc == sp.FRONTEND)
    front_end[own[m]] = dur[m]
    first_sched, first_gen = np.full(n, NO_NS, np.int64), np.full(n, NO_NS, np.int64)
    m = ok & (kc == sp.QUEUE)
    if m.any():
        qi = np.flatnonzero(m)
        m[qi] = [not kids[j][sp.INCOMPLETE] for j in qi.tolist()]  # the engine never scheduled it
        queue[own[m]] = dur[m]
        first_sched[own[m]] = kend[m]
    m = ok & (kc == sp.PREFILL)
    prefill[own[m]] = dur[m]
    first_sched[own[m]] = kstart[m]
    first_gen[own[m]] = kend[m]
    m = ok & (kc == sp.DECODE)
    decode[own[m]] = dur[m]
    m = ok & (kc == sp.PREEMPTION)
    preemptions = np.bincount(own[m], minlength=n).astype(np.int64)
    preempted = np.bincount(own[m], weights=dur[m].astype(np.float64), minlength=n)
    # the HTTP server span between a client span and the engine's (engine_hooks.asgi): the engine
    # record gets its times, and pairs with the server span's parent
    eng = np.flatnonzero(code == sp.ENGINE)
    parents = [recs[e][sp.PARENT_ID] for e in eng.tolist()]
    server_received = np.full(n, NO_NS, np.int64)
    server_chunks: list = [None] * n
    server_span: dict[int, tuple] = {}
    srv_at = np.flatnonzero(codes == sp.SERVER)
    if len(srv_at):
        srv = {(int(tix[i]), flat[i][sp.SPAN_ID]): flat[i] for i in srv_at.tolist()}
        for j, e in enumerate(eng.tolist()):
            s = srv.get((int(rec_tix[e]), parents[j]))
            if s is None:
                continue
            parents[j] = s[sp.PARENT_ID]
            server_received[e] = s[sp.START]
            ch = s[sp.CHUNK_OFFSETS]
            if type(ch) is bytes and len(ch) % 8 == 0:
                # sorted: chunks are written in order, and a sender that says otherwise must not
                # turn the lookups below into nonsense
                server_chunks[e] = np.sort(s[sp.START] + np.frombuffer(ch, np.int64))
                server_span[e] = s
    generated: list = [None] * n  # the engine's own generation times, apart from its token events
    for e in eng.tolist():
        r = recs[e]
        g = r[sp.GEN_OFFSETS]
        if type(g) is bytes and g and len(g) % 8 == 0:
            k = r[sp.GEN_TOKENS]
            gt = np.frombuffer(k, np.int64) if type(k) is bytes and len(k) == len(g) else None
            generated[e] = (r[sp.START] + np.frombuffer(g, np.int64), gt)
    if adopted.phases:  # what vLLM's and SGLang's own spans said (collector/pipeline/foreign_spans.py)
        for r, t_sid in enumerate(zip(rec_tix.tolist(), sids)):
            ph = adopted.phases.get(t_sid)
            if ph is None:
                continue
            for col, v in (
                (front_end, ph.front_end), (queue, ph.queue), (prefill, ph.prefill), (decode, ph.decode),
                (first_sched, ph.first_scheduled), (first_gen, ph.first_generated),
            ):  # fmt: skip
                if v is not None:
                    col[r] = v
            if ph.generated is not None:
                generated[r] = (ph.generated, None)
    # pairs: an engine request span whose parent is a client request span of its trace (or the
    # HTTP server span under it); traces where that does not pair everything it could go through
    # the general matching
    cl = _owners(key, parents, rec_tix[eng], rec_tix, per_trace)
    good = cl >= 0
    good[good] = code[cl[good]] == sp.CLIENT
    ci, ei = cl[good], eng[good]
    if len(np.unique(ci)) < len(ci):  # a client span claimed twice (n > 1): the general matching decides
        values, counts_ = np.unique(ci, return_counts=True)
        once = ~np.isin(ci, values[counts_ > 1])
        ci, ei = ci[once], ei[once]
    nt = len(traces)
    clients = np.bincount(rec_tix[code == sp.CLIENT], minlength=nt)
    engines = np.bincount(rec_tix[code == sp.ENGINE], minlength=nt)
    paired = np.bincount(rec_tix[ci], minlength=nt)
    redo = np.flatnonzero(paired < np.minimum(clients, engines))
    pairs = list(zip(ci.tolist(), ei.tolist()))
    if len(redo):
        redo_set = set(redo.tolist())
        rt = rec_tix.tolist()
        pairs = [(c, e) for c, e in pairs if rt[c] not in redo_set]
        # each redone trace's records, found once for the batch (a scan per trace was O(n^2): a
        # batch of 8,000 traces behind a traced proxy took 6.7 s)
        order = np.argsort(rec_tix, kind="stable")
        starts = np.searchsorted(rec_tix[order], redo)
        ends = np.searchsorted(rec_tix[order], redo, side="right")
        for t, a, b in zip(redo.tolist(), starts.tolist(), ends.tolist()):
            mine = order[a:b].tolist()
            pairs += _pair(
                [r for r in mine if code[r] == sp.CLIENT],
                [r for r in mine if code[r] == sp.ENGINE],
                recs,
                traces[t].spans,
            )
    server_of: list[tuple[int, int]] = []
    if server_span:  # the server boundary: a record of its own per engine record under a server span
        extra = [_server_record(recs[e], server_span[e], server_chunks[e]) for e in server_span]
        m = len(extra)
        server_of = list(zip(range(n, n + m), server_span))
        recs = recs + extra
        code = np.concatenate([code, np.full(m, sp.SERVER, code.dtype)])
        unknown = lambda a, v: np.concatenate([a, np.full(m, v, a.dtype)])
        front_end, queue, prefill, decode = (unknown(a, NO_NS) for a in (front_end, queue, prefill, decode))
        first_sched, first_gen = unknown(first_sched, NO_NS), unknown(first_gen, NO_NS)
        server_received = unknown(server_received, NO_NS)
        preemptions, preempted = unknown(preemptions, 0), unknown(preempted, 0.0)
        server_chunks = server_chunks + [None] * m
        generated = generated + [None] * m
        summarised = np.concatenate([summarised, summarised[list(server_span)]])  # the server's copy of its events
    return _Requests(
        recs,
        code,
        front_end,
        queue,
        prefill,
        decode,
        preemptions,
        preempted,
        first_sched,
        first_gen,
        pairs,
        server_received,
        server_chunks,
        generated,
        server_of,
        summarised,
    )


#: More tokens than this in one event is not an output chunk: the event is invalid.
MAX_EVENT_TOKENS = 1 << 31


def _events(offsets: tuple, tokens: tuple, duration_ns: np.ndarray) -> tuple[np.ndarray, ...]:
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


def _seconds(ns: np.ndarray) -> np.ndarray:
    """int64 ns durations (NO_NS: unknown) -> float seconds (NaN)."""
    return np.where(ns != NO_NS, ns / _NS, np.nan)


def _model(m, service) -> str:
    if m and m is not sp.INVALID:
        return str(m)
    return str(service) if service and service is not sp.INVALID else "unknown"


def _status(s, code: int) -> str:
    if s in _STATUS_OK:
        return s
    return "error" if s or code == 2 else "ok"


#: The client TTFT's parts a (client, engine) pair gives beyond the engine's own phases.
PAIR_PARTS = OUTER


def pair_parts(
    c_submit: np.ndarray,
    c_sent: np.ndarray,
    c_first: np.ndarray,
    e_submit: np.ndarray,
    e_first_generated: np.ndarray,
    e_first_out: np.ndarray,
    received: np.ndarray,
    first_chunk: np.ndarray,
) -> dict[str, np.ndarray]:
    """The outer parts of the client TTFT (:data:`PAIR_PARTS`) of (client, engine) pairs, in
    seconds, NaN where unknown. Arrays aligned by pair, times in Unix ns (``NO_NS`` unknown): the
    client's call, the moment it began writing the request and its first token (client clock); the
    engine's arrival, first token generated and first output handed out (engine clock); the HTTP
    server's first byte read and the first body chunk it wrote once the engine had a token out
    (server clock). Parts across two clocks are uncorrected (:mod:`collector.analysis.compare` corrects
    them); without a send time, ``network_in`` starts at the call."""
    k = len(c_submit)
    out = {name: np.full(k, np.nan) for name in PAIR_PARTS}
    out["to_engine"][:] = (e_submit - c_submit) / _NS
    said = c_sent != NO_NS
    out["client_send"][said] = (c_sent[said] - c_submit[said]) / _NS
    sent = np.where(said, c_sent, c_submit)
    srv = received != NO_NS
    out["network_in"][srv] = (received[srv] - sent[srv]) / _NS
    out["api_in"][srv] = (e_submit[srv] - received[srv]) / _NS
    engine_first = np.where(e_first_generated != NO_NS, e_first_generated, e_first_out)
    ok = (c_first != NO_NS) & (engine_first != NO_NS)
    out["delivery"][ok] = (c_first[ok] - engine_first[ok]) / _NS
    chunk = ok & (first_chunk != NO_NS)
    out["api_out"][chunk] = (first_chunk[chunk] - engine_first[chunk]) / _NS
    out["network_out"][chunk] = (c_first[chunk] - first_chunk[chunk]) / _NS
    return out


def derive(traces: Iterable[ReleasedTrace]) -> tuple[RecordBatch, RequestMetrics]:
    """Records of every request span in ``traces``, with their per-request metrics (the pooled
    ITL samples too, for the exporters)."""
    rq = _requests(traces if isinstance(traces, list) else list(traces))
    recs = rq.recs
    n = len(recs)
    cols = list(zip(*recs)) if n else [()] * sp.WIDTH
    submit = np.array(cols[sp.START], np.int64)
    end = np.array(cols[sp.END], np.int64)
    start, offs, toks, rejected = _events(cols[sp.OFFSETS], cols[sp.TOKENS], end - submit)
    counts = np.diff(start)
    has = counts > 0
    first_event = np.full(n, NO_NS, np.int64)  # Unix ns of each record's first token event
    first_event[has] = submit[has] + offs[start[:-1][has]]
    queue, prefill, decode = _seconds(rq.queue_ns), _seconds(rq.prefill_ns), _seconds(rq.decode_ns)
    front_end = _seconds(rq.front_end_ns)
    preemptions, preemption_time = rq.preemptions, rq.preempted_ns / _NS
    first_sched, first_gen = rq.first_scheduled_ns, rq.first_generated_ns
    engine_delivery = np.full(n, np.nan)
    m = has & (first_gen != NO_NS)
    engine_delivery[m] = (first_event[m] - first_gen[m]) / _NS
    outer = {name: np.full(n, np.nan) for name in PAIR_PARTS}  # the client records' outer TTFT parts
    stall_core, stall_server = np.full(n, np.nan), np.full(n, np.nan)
    server_received, server_first = rq.server_received_ns, np.full(n, NO_NS, np.int64)
    with_server = np.flatnonzero(server_received != NO_NS).tolist() if len(rq.server_chunks) else []
    for e in with_server:  # the first chunk written once the engine had a token out
        ch = rq.server_chunks[e]
        if ch is not None and has[e] and len(ch):
            k = int(np.searchsorted(ch, first_event[e], side="left"))
            if k < len(ch):
                server_first[e] = ch[k]
    paired = np.zeros(n, bool)
    if rq.pairs:
        ci, ei = np.array(rq.pairs, np.int64).T
        paired[ci] = paired[ei] = True
        off = np.fromiter((v if type(v) is int else -1 for v in cols[sp.SEND_OFFSET]), np.int64, n)
        sent = np.where((off >= 0) & (off <= end - submit), submit + off, NO_NS)
        for name, v in pair_parts(
            submit[ci], sent[ci], first_event[ci], submit[ei], first_gen[ei], first_event[ei],
            server_received[ei], server_first[ei],
        ).items():  # fmt: skip
            outer[name][ci] = v
        for col in (front_end, queue, prefill, decode, preemption_time, engine_delivery, preemptions):
            col[ci] = col[ei]
        for col in (first_sched, first_gen, server_received, server_first):
            col[ci] = col[ei]
        stall_core, stall_server = stall_layers(ci, ei, submit, start, offs, toks, rq.generated, rq.server_chunks)
    # one object per distinct value (each span brings its own copy): less to hold, pickle, compare
    same: dict = {}
    status = [
        same.setdefault(x, x) if x in _STATUS_OK else _status(x, c)
        for x, c in zip(cols[sp.STATUS], cols[sp.STATUS_CODE])
    ]
    request_id = [
        r if type(r) is str and r and c is None else _request_id(s)
        for r, c, s in zip(cols[sp.REQUEST_ID], cols[sp.CHOICE], recs)
    ]
    choice = np.fromiter((c if type(c) is int else -1 for c in cols[sp.CHOICE]), np.int64, n)
    input_tokens = np.array([v if type(v) is int else -1 for v in cols[sp.INPUT_TOKENS]], np.int64)
    # a response not streamed has no token events: its tokens are its usage, observed at its end
    usage = np.fromiter(
        (v if type(v) is int and 0 < v < MAX_EVENT_TOKENS else 0 for v in cols[sp.OUTPUT_TOKENS]), np.int64, n
    )
    untimed = np.where(counts == 0, usage, 0)
    rm = request_metrics(
        timeline_batch(
            request_id, submit, end, status, start, offs, toks, input_tokens,
            untimed_tokens=untimed, summarised=rq.summarised,
        )
    )  # fmt: skip
    # sampling: each record counts for 1 / the probability it was kept with; an engine or server
    # record whose own span does not say takes its client's (the sampler decided there), else each other's.
    # Below MIN_SAMPLING_P a probability is not taken (a sender could make one span count for 1e300)
    prob = np.fromiter(
        (float(v) if type(v) in (float, int) and MIN_SAMPLING_P <= v <= 1 else np.nan for v in cols[sp.SAMPLING_P]),
        np.float64,
        n,
    )
    for c, e in rq.pairs:
        if prob[e] != prob[e]:
            prob[e] = prob[c]
    for sv, e in rq.server_of:
        if prob[e] != prob[e]:
            prob[e] = prob[sv]
        if prob[sv] != prob[sv]:
            prob[sv] = prob[e]
    weight = np.where(np.isfinite(prob), 1.0 / prob, 1.0)
    unread = np.full(n, -1, np.int64)
    if rq.pairs:
        ci, ei = np.array(rq.pairs, np.int64).T
        gone = np.fromiter((status[c] == "cancelled" for c in ci.tolist()), bool, len(ci))
        lost = np.maximum(rm.output_tokens[ei] - rm.output_tokens[ci], 0)
        unread[ci[gone]] = unread[ei[gone]] = lost[gone]
    peer: list = [None] * n
    run_id = [same.setdefault(v, v) if type(v) is str and v else None for v in cols[sp.RUN_ID]]
    warmup = np.fromiter((v is True for v in cols[sp.WARMUP]), bool, n)
    for c, e in rq.pairs:
        peer[c], peer[e] = request_id[e], request_id[c]
        if run_id[e] is None:  # the engine does not know the bench run: its client does
            run_id[e] = run_id[c]
        warmup[e] |= warmup[c]
    for sv, e in rq.server_of:  # the server boundary belongs to the same run
        run_id[sv] = run_id[e]
        warmup[sv] = warmup[e]
    violations = invariants.check(
        rq.code,
        submit,
        rq.first_scheduled_ns,
        rq.first_generated_ns,
        first_event,
        rm.ttft,
        rm.output_tokens,
        rejected,
        rq.server_received_ns,
        rq.pairs,
        rq.server_of,
        cols[sp.VIOLATIONS] if n else [],
    )
    batch = RecordBatch(
        trace_id=[same.setdefault(t, t.hex()) for t in cols[sp.TRACE_ID]],
        boundary=[sp.BOUNDARY_OF[c] for c in cols[sp.CODE]],
        request_id=request_id,
        model=[
            same.setdefault(m, m) if type(m) is str and m else _model(m, svc)
            for m, svc in zip(cols[sp.MODEL], cols[sp.SERVICE])
        ],
        service=[same.setdefault(v, v) if type(v) is str and v else None for v in cols[sp.SERVICE]],
        status=status,
        run_id=run_id,
        warmup=warmup,
        choice=choice,
        events_rejected=rejected,
        violations=violations,
        submit_ns=submit,
        end_ns=end,
        event_start=start,
        event_offsets_ns=offs,
        event_tokens=toks,
        input_tokens=input_tokens,
        output_tokens=rm.output_tokens,
        estimated_tokens=np.array([bool(e) and e is not sp.INVALID for e in cols[sp.ESTIMATED]], bool),
        events_summarised=rq.summarised,
        ttft=rm.ttft,
        tpot=rm.tpot,
        e2e=rm.e2e,
        itl_max=rm.itl_max,
        front_end=front_end,
        queue=queue,
        prefill=prefill,
        decode=decode,
        preemptions=preemptions,
        preemption_time=preemption_time,
        first_scheduled_ns=first_sched,
        first_generated_ns=first_gen,
        engine_delivery=engine_delivery,
        **outer,
        server_received_ns=server_received,
        server_first_chunk_ns=server_first,
        stall_core_gap=stall_core,
        stall_server_gap=stall_server,
        tokens_unread=unread,
        tokens_after_abort=np.fromiter(
            (v if type(v) is int and 0 <= v < 2**62 else -1 for v in cols[sp.AFTER_ABORT]), np.int64, n
        ),
        sample_weight=weight,
        paired=paired,
        peer_request_id=peer,
    )
    if rq.pairs:
        pci, pei = np.array(rq.pairs, np.int64).T
        batch.pairs = (pci, pei)
    return batch, rm
