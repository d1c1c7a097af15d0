"""Derivation: assembled traces -> one record per request and boundary, as a columnar
:class:`~collector.records.RecordBatch`.

Per request span (``llm.request``: engine, ``llm.client.request``: client): submit and end from
the span, token events from ``llm.token_event.offsets_ns`` / ``.tokens`` (int64 bytes from the
walk, joined and read for the whole batch at once); engine phases from its child spans (queue,
prefill, decode, preemptions). Per-request metrics (TTFT, TPOT, E2E, largest ITL) come from the
core's vectorised :func:`otel_llm.metrics.request_metrics`, one call per batch.

When a trace holds both boundaries of a request, the client TTFT is decomposed exactly, in
integer ns: ``network_in`` (engine arrival - client send) + ``queue`` + ``prefill`` (to the
engine's first token *generated*) + ``delivery`` (client first token - engine first token
generated) = client TTFT. Without the engine's phases (vLLM stats off), ``delivery`` runs from
the engine's first output handed out, and ``queue``/``prefill`` are unknown.

The only Python per span is one pass that sorts each trace's spans into requests and phases;
everything per record after that is numpy over the batch.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from otel_llm.metrics import RequestMetrics, request_metrics
from otel_llm.timeline import STATUS_CODE, TimelineBatch

from . import spans as sp
from .assembly import ReleasedTrace
from .records import NO_NS, RecordBatch

_NS = 1e9
_NO_PHASES = (None, None, None, 0, 0, None, None)
_STATUS_OK = frozenset(STATUS_CODE)


def _phases(sid: bytes, kids: list[tuple]) -> tuple:
    """(queue, prefill, decode ns, preemptions, preempted ns, first scheduled, first generated
    Unix ns) of the engine request span ``sid``, from its child spans."""
    q = p = d = fs = fg = None
    n = pt = 0
    for k in kids:
        if k[sp.PARENT_ID] != sid:
            continue
        c = k[sp.CODE]
        if c == sp.QUEUE:
            if not k[sp.INCOMPLETE]:
                q, fs = k[sp.END] - k[sp.START], k[sp.END]
        elif c == sp.PREFILL:
            p, fs, fg = k[sp.END] - k[sp.START], k[sp.START], k[sp.END]
        elif c == sp.DECODE:
            d = k[sp.END] - k[sp.START]
        elif c == sp.PREEMPTION:
            n += 1
            pt += k[sp.END] - k[sp.START]
    return (q, p, d, n, pt, fs, fg)


def _request_id(s: tuple) -> str:
    r = s[sp.REQUEST_ID]
    return str(r) if r and r is not sp.INVALID else s[sp.SPAN_ID].hex()


def _pair(clients: list[tuple], engines: list[tuple], spans: list[tuple], base: int) -> list[tuple[int, int]]:
    """Match the client and engine request spans of one trace (records ``base`` ... in that
    order): by ancestry (the engine span descends from the client span through the injected
    traceparent), then by request id, then one to one."""
    if len(clients) == 1 and len(engines) == 1 and engines[0][sp.PARENT_ID] == clients[0][sp.SPAN_ID]:
        return [(base, base + 1)]
    parent_of = {s[sp.SPAN_ID]: s[sp.PARENT_ID] for s in spans}
    nc = len(clients)
    free = list(range(len(engines)))
    pairs = []
    for ci, c in enumerate(clients):
        match = None
        for j, ei in enumerate(free):
            p, hops = engines[ei][sp.PARENT_ID], 0
            while p and hops < 64:
                if p == c[sp.SPAN_ID]:
                    match = j
                    break
                p, hops = parent_of.get(p, b""), hops + 1
            if match is not None:
                break
        if match is None:
            rid = _request_id(c)
            match = next((j for j, ei in enumerate(free) if _request_id(engines[ei]) == rid), None)
        if match is None and nc == 1 and len(free) == 1:
            match = 0
        if match is not None:
            pairs.append((base + ci, base + nc + free.pop(match)))
    return pairs


def _requests(traces: Iterable[ReleasedTrace]) -> tuple[list[tuple], list[tuple], list[tuple[int, int]]]:
    """The request spans of every trace (clients, then engines, trace by trace), their phases,
    and the (client, engine) record pairs."""
    recs: list[tuple] = []
    phases: list[tuple] = []
    pairs: list[tuple[int, int]] = []
    CLIENT, ENGINE, CODE, SID = sp.CLIENT, sp.ENGINE, sp.CODE, sp.SPAN_ID
    for t in traces:
        cl, en, kids = [], [], []
        for s in t.spans:
            c = s[CODE]
            if c == CLIENT:
                cl.append(s)
            elif c == ENGINE:
                en.append(s)
            else:
                kids.append(s)
        if not cl and not en:
            continue
        base = len(recs)
        recs += cl
        phases += [_NO_PHASES] * len(cl)
        for s in en:
            recs.append(s)
            phases.append(_phases(s[SID], kids) if kids else _NO_PHASES)
        if cl and en:
            pairs += _pair(cl, en, t.spans, base)
    return recs, phases, pairs


def _events(offsets: tuple, tokens: tuple) -> tuple:
    """Token events of every record from its int64 byte arrays, cleaned in one vectorised pass:
    events with no token dropped, each record's events in time order. A record whose arrays
    are unusable (another type, mismatched lengths) keeps none.
    Returns (event_start, offsets, tokens, blobs per record, unusable count)."""
    n = len(offsets)
    ob = [o if type(o) is bytes else b"" for o in offsets]
    tb = [k if type(k) is bytes else b"" for k in tokens]
    no = np.fromiter(map(len, ob), np.int64, n)
    nt = np.fromiter(map(len, tb), np.int64, n)
    bad = (no != nt) | (no % 8 != 0)
    unusable = int(bad.sum())
    if unusable:
        for i in np.flatnonzero(bad).tolist():
            ob[i] = tb[i] = b""
        no[bad] = 0
    counts = no // 8
    offs = np.frombuffer(b"".join(ob), np.int64)
    toks = np.frombuffer(b"".join(tb), np.int64)
    seg = np.repeat(np.arange(n), counts)
    unsorted = (np.diff(offs) < 0) & (seg[1:] == seg[:-1]) if len(offs) > 1 else np.zeros(0, bool)
    if (toks <= 0).any() or unsorted.any():
        order = np.lexsort((offs, seg))  # stable by (record, time)
        offs, toks, seg = offs[order], toks[order], seg[order]
        keep = toks > 0  # chunks with no token are not token events
        offs, toks, seg = offs[keep], toks[keep], seg[keep]
        counts = np.bincount(seg, minlength=n)
        start = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=start[1:])
        st = start.tolist()
        blobs = [(offs[a:b].tobytes(), toks[a:b].tobytes()) for a, b in zip(st[:-1], st[1:])]
    else:
        start = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=start[1:])
        blobs = list(zip(ob, tb))
    return start, offs, toks, blobs, unusable


def _float_ns(values: Iterable) -> np.ndarray:
    """ns durations (None: unknown) -> float seconds (NaN)."""
    return np.array([np.nan if v is None else v for v in values], np.float64) / _NS


def _int_ns(values: Iterable) -> np.ndarray:
    return np.array([NO_NS if v is None else v for v in values], np.int64)


def _model(m, service) -> str:
    if m and m is not sp.INVALID:
        return str(m)
    return str(service) if service and service is not sp.INVALID else "unknown"


def _status(s, code: int) -> str:
    if s in _STATUS_OK:
        return s
    return "error" if s or code == 2 else "ok"


def derive(traces: Iterable[ReleasedTrace]) -> tuple[RecordBatch, RequestMetrics]:
    """Records of every request span in ``traces``, with their per-request metrics (the pooled
    ITL samples too, for the exporters)."""
    recs, phases, pairs = _requests(traces)
    n = len(recs)
    cols = list(zip(*recs)) if n else [()] * sp.WIDTH
    submit = np.array(cols[sp.START], np.int64)
    end = np.array(cols[sp.END], np.int64)
    start, offs, toks, blobs, _ = _events(cols[sp.OFFSETS], cols[sp.TOKENS])
    counts = np.diff(start)
    has = counts > 0
    first_event = np.full(n, NO_NS, np.int64)  # Unix ns of each record's first token event
    first_event[has] = submit[has] + offs[start[:-1][has]]
    pc = list(zip(*phases)) if n else [()] * 7
    queue, prefill, decode = _float_ns(pc[0]), _float_ns(pc[1]), _float_ns(pc[2])
    preemptions = np.array(pc[3], np.int64)
    preemption_time = np.array(pc[4], np.float64) / _NS
    first_sched, first_gen = _int_ns(pc[5]), _int_ns(pc[6])
    engine_delivery = np.full(n, np.nan)
    m = has & (first_gen != NO_NS)
    engine_delivery[m] = (first_event[m] - first_gen[m]) / _NS
    network_in = np.full(n, np.nan)
    delivery = np.full(n, np.nan)
    paired = np.zeros(n, bool)
    if pairs:
        ci, ei = np.array(pairs, np.int64).T
        paired[ci] = paired[ei] = True
        network_in[ci] = (submit[ei] - submit[ci]) / _NS
        for col in (queue, prefill, decode, preemption_time, engine_delivery, preemptions, first_sched, first_gen):
            col[ci] = col[ei]
        engine_first = np.where(first_gen[ei] != NO_NS, first_gen[ei], first_event[ei])
        ok = has[ci] & (engine_first != NO_NS)
        delivery[ci[ok]] = (first_event[ci[ok]] - engine_first[ok]) / _NS
    inp = cols[sp.INPUT_TOKENS]
    # one object per distinct value (each span brings its own copy): less to hold, pickle, compare
    same = {}
    status = [same.setdefault(x, x) for x in map(_status, cols[sp.STATUS], cols[sp.STATUS_CODE])]
    epoch = int(submit.min()) if n else 0
    rel = submit - epoch
    timelines = TimelineBatch([], rel / _NS, (end - epoch) / _NS, np.array([STATUS_CODE[s] for s in status], np.int8),
                              start, (np.repeat(rel, counts) + offs) / _NS, toks,
                              np.array([v if type(v) is int else -1 for v in inp], np.int64))
    rm = request_metrics(timelines)
    batch = RecordBatch(
        trace_id=[same.setdefault(t, t.hex()) for t in cols[sp.TRACE_ID]],
        boundary=[sp.BOUNDARY_OF[c] for c in cols[sp.CODE]],
        request_id=[_request_id(s) for s in recs],
        model=[same.setdefault(x, x) for x in map(_model, cols[sp.MODEL], cols[sp.SERVICE])],
        status=status, submit_ns=submit, end_ns=end, event_start=start, event_offsets_ns=offs,
        event_tokens=toks, event_blobs=blobs, input_tokens=timelines.input_tokens,
        output_tokens=rm.output_tokens,
        estimated_tokens=np.array([bool(e) and e is not sp.INVALID for e in cols[sp.ESTIMATED]], bool),
        ttft=rm.ttft, tpot=rm.tpot, e2e=rm.e2e, itl_max=rm.itl_max, queue=queue, prefill=prefill, decode=decode,
        preemptions=preemptions, preemption_time=preemption_time, first_scheduled_ns=first_sched,
        first_generated_ns=first_gen, engine_delivery=engine_delivery, network_in=network_in, delivery=delivery,
        paired=paired)
    return batch, rm
