"""Derivation: assembled traces -> one :class:`RequestRecord` per request and boundary.

Per request span (``llm.request``: engine, ``llm.client.request``: client): submit and end from
the span, token events from ``llm.token_event.offsets_ns`` / ``.tokens`` (decoded for the whole
batch at once, see :mod:`collector.int_arrays`); engine phases from its child spans (queue,
prefill, decode, preemptions). Per-request metrics (TTFT, TPOT, E2E, largest ITL) come from the
core's vectorised :func:`otel_llm.metrics.request_metrics`, one call per batch.

When a trace holds both boundaries of a request, the client TTFT is decomposed exactly, in
integer ns: ``network_in`` (engine arrival - client send) + ``queue`` + ``prefill`` (to the
engine's first token *generated*) + ``delivery`` (client first token - engine first token
generated) = client TTFT. Without the engine's phases (vLLM stats off), ``delivery`` runs from
the engine's first output handed out, and ``queue``/``prefill`` are unknown.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import numpy as np

from otel_llm import semconv as sc
from otel_llm.metrics import RequestMetrics, request_metrics, segment_sum
from otel_llm.otlp_spans import SpanRecord
from otel_llm.timeline import STATUS_CODE

from .assembly import ReleasedTrace
from .int_arrays import RawIntArray, decode_int_arrays
from .records import RequestRecord, records_to_batch

_EMPTY = np.zeros(0, np.int64)


def _model(span: SpanRecord) -> str:
    return str(span.attributes.get(sc.REQUEST_MODEL) or span.resource.get("service.name") or "unknown")


def _record(span: SpanRecord, boundary: str) -> RequestRecord:
    a = span.attributes
    status = a.get(sc.STATUS) or ("error" if span.status_code == 2 else "ok")
    if status not in STATUS_CODE:
        status = "error"
    inp = a.get(sc.INPUT_TOKENS)
    return RequestRecord(
        trace_id=span.trace_id, boundary=boundary, request_id=str(a.get(sc.REQUEST_ID) or span.span_id),
        model=_model(span), status=status, submit_ns=span.start_ns, end_ns=span.end_ns,
        input_tokens=inp if isinstance(inp, int) and not isinstance(inp, bool) else None,
        estimated_tokens=bool(a.get(sc.TOKEN_EVENT_ESTIMATED, False)),
    )


def _engine_phases(rec: RequestRecord, children: list[SpanRecord]) -> None:
    for c in children:
        if c.name == sc.SPAN_QUEUE and not c.attributes.get("llm.queue.incomplete"):
            rec.queue = c.duration_ns / 1e9
            rec.first_scheduled_ns = c.end_ns
        elif c.name == sc.SPAN_PREFILL:
            rec.prefill = c.duration_ns / 1e9
            rec.first_scheduled_ns = c.start_ns
            rec.first_generated_ns = c.end_ns
        elif c.name == sc.SPAN_DECODE:
            rec.decode = c.duration_ns / 1e9
        elif c.name == sc.SPAN_PREEMPTION:
            rec.preemptions += 1
            rec.preemption_time += c.duration_ns / 1e9


def _pair(clients: list[tuple[SpanRecord, RequestRecord]], engines: list[tuple[SpanRecord, RequestRecord]],
          parent_of: dict[str, str]) -> list[tuple[RequestRecord, RequestRecord]]:
    """Match client and engine records of one trace: by ancestry (the engine span descends from
    the client span through the injected traceparent), then by request id, then one to one."""
    pairs = []
    free = list(engines)
    for cspan, crec in clients:
        match = None
        for i, (espan, erec) in enumerate(free):
            p, hops = espan.parent_span_id, 0
            while p and hops < 64:
                if p == cspan.span_id:
                    match = i
                    break
                p, hops = parent_of.get(p, ""), hops + 1
            if match is not None:
                break
        if match is None:
            match = next((i for i, (_, e) in enumerate(free) if e.request_id == crec.request_id), None)
        if match is None and len(clients) == 1 and len(free) == 1:
            match = 0
        if match is not None:
            pairs.append((crec, free.pop(match)[1]))
    return pairs


def decompose(client: RequestRecord, engine: RequestRecord) -> None:
    """Fill the client record's TTFT decomposition from its engine record (seconds)."""
    client.paired = engine.paired = True
    client.network_in = (engine.submit_ns - client.submit_ns) / 1e9
    client.queue, client.prefill, client.decode = engine.queue, engine.prefill, engine.decode
    client.first_scheduled_ns, client.first_generated_ns = engine.first_scheduled_ns, engine.first_generated_ns
    client.preemptions, client.preemption_time = engine.preemptions, engine.preemption_time
    client.engine_delivery = engine.engine_delivery
    if len(client.event_offsets_ns):
        engine_first = engine.first_generated_ns if engine.first_generated_ns is not None else engine.first_event_ns
        if engine_first is not None:
            client.delivery = (client.first_event_ns - engine_first) / 1e9


def _trace_records(trace: ReleasedTrace, spans_out: list[SpanRecord]) -> tuple[list[RequestRecord], list]:
    children: dict[str, list[SpanRecord]] = defaultdict(list)
    parent_of: dict[str, str] = {}
    clients, engines = [], []
    for s in trace.spans:
        parent_of[s.span_id] = s.parent_span_id
        if s.name == sc.SPAN_CLIENT_REQUEST:
            clients.append(s)
        elif s.name == sc.SPAN_REQUEST:
            engines.append(s)
        elif s.parent_span_id:
            children[s.parent_span_id].append(s)
    crecs = [(s, _record(s, "client")) for s in clients]
    erecs = []
    for s in engines:
        r = _record(s, "engine")
        _engine_phases(r, children.get(s.span_id, ()))
        erecs.append((s, r))
    spans_out.extend(s for s, _ in crecs)
    spans_out.extend(s for s, _ in erecs)
    return [r for _, r in crecs] + [r for _, r in erecs], _pair(crecs, erecs, parent_of)


def _attach_events(records: list[RequestRecord], spans: list[SpanRecord]) -> int:
    """Decode every record's token-event arrays in bulk; returns how many arrays were unusable
    (mismatched lengths, non-integers): those records keep no token events."""
    raw_idx, raw_blobs, arrays = [], [], []
    for i, s in enumerate(spans):
        for key in (sc.TOKEN_EVENT_OFFSETS, sc.TOKEN_EVENT_TOKENS):
            v = s.attributes.get(key)
            if isinstance(v, RawIntArray):
                raw_idx.append(len(arrays))
                raw_blobs.append(v)
                arrays.append(None)
            elif isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                arrays.append(np.asarray(v, dtype=np.int64))
            else:
                arrays.append(_EMPTY if v is None else None)
    for j, arr in zip(raw_idx, decode_int_arrays(raw_blobs)):
        arrays[j] = arr
    # validate and clean every record's events in one vectorised pass over the batch
    good = [i for i in range(len(records)) if arrays[2 * i] is not None and arrays[2 * i + 1] is not None
            and len(arrays[2 * i]) == len(arrays[2 * i + 1])]
    if not good:
        return len(records)
    offs_list = [arrays[2 * i] for i in good]
    toks_list = [arrays[2 * i + 1] for i in good]
    counts = np.fromiter(map(len, offs_list), dtype=np.int64, count=len(good))
    offs, toks = np.concatenate(offs_list), np.concatenate(toks_list)
    seg = np.repeat(np.arange(len(good)), counts)
    keep = toks > 0  # chunks with no token are not token events
    unsorted = np.zeros(len(good), bool)
    if len(offs) > 1:
        back = (np.diff(offs) < 0) & (seg[1:] == seg[:-1])
        unsorted[seg[1:][back]] = True
    if not keep.all() or unsorted.any():
        order = np.lexsort((offs, seg))  # stable by (record, time)
        offs, toks, seg = offs[order], toks[order], seg[order]
        keep = toks > 0
        offs, toks, seg = offs[keep], toks[keep], seg[keep]
        counts = np.bincount(seg, minlength=len(good))
    ends = np.cumsum(counts)
    starts = ends - counts
    sums = segment_sum(toks, np.concatenate(([0], ends)))
    for k, i in enumerate(good):
        r = records[i]
        a, b = int(starts[k]), int(ends[k])
        r.event_offsets_ns, r.event_tokens = offs[a:b], toks[a:b]
        r.output_tokens = int(sums[k])
        if r.first_generated_ns is not None and b > a:
            r.engine_delivery = (r.submit_ns + int(offs[a]) - r.first_generated_ns) / 1e9
    return len(records) - len(good)


def fill_metrics(records: list[RequestRecord]) -> RequestMetrics:
    """TTFT, TPOT, E2E and largest ITL of every record, in one vectorised pass; returns the
    per-request metrics (with the pooled ITL samples) for the exporters."""
    batch = records_to_batch(records, epoch_ns=min((r.submit_ns for r in records), default=0))
    rm = request_metrics(batch)
    for r, ttft, tpot, e2e, itl_max in zip(records, rm.ttft.tolist(), rm.tpot.tolist(), rm.e2e.tolist(),
                                          rm.itl_max.tolist()):
        r.ttft = None if ttft != ttft else ttft  # NaN -> None
        r.tpot = None if tpot != tpot else tpot
        r.e2e = e2e
        r.itl_max = None if itl_max != itl_max else itl_max
    return rm


def derive(traces: Iterable[ReleasedTrace]) -> tuple[list[RequestRecord], RequestMetrics]:
    records: list[RequestRecord] = []
    spans: list[SpanRecord] = []
    pairs: list = []
    for t in traces:
        recs, prs = _trace_records(t, spans)
        records.extend(recs)
        pairs.extend(prs)
    _attach_events(records, spans)
    for c, e in pairs:
        decompose(c, e)
    return records, fill_metrics(records)
