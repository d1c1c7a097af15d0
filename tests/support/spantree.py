"""Helpers to check span trees read back from OTLP (tests only)."""

from __future__ import annotations

from collections import defaultdict

from otel_llm import semconv as sc
from otel_llm.otlp.span_records import SpanRecord

PHASES = (sc.SPAN_FRONTEND, sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE, sc.SPAN_PREEMPTION, sc.SPAN_STREAM)


def request_trees(spans: list[SpanRecord], root_name: str = sc.SPAN_REQUEST) -> dict[str, dict]:
    """{llm.request.id: {"root": span, "children": {name: [spans]}}} for every request span."""
    by_parent: dict[tuple[str, str], list[SpanRecord]] = defaultdict(list)
    for s in spans:
        by_parent[(s.trace_id, s.parent_span_id)].append(s)
    out = {}
    for s in spans:
        if s.name == root_name:
            kids: dict[str, list[SpanRecord]] = defaultdict(list)
            for c in by_parent[(s.trace_id, s.span_id)]:
                kids[c.name].append(c)
            out[s.attributes[sc.REQUEST_ID]] = {"root": s, "children": kids}
    return out


def check_nesting_and_order(tree: dict) -> None:
    """Phases inside the request; queue before prefill before decode; preemptions in between."""
    root, kids = tree["root"], tree["children"]
    for name, lst in kids.items():
        for c in lst:
            assert root.start_ns <= c.start_ns <= c.end_ns <= root.end_ns, (name, c, root)
            assert c.attributes[sc.BOUNDARY] == root.attributes[sc.BOUNDARY]
    q = kids[sc.SPAN_QUEUE]
    fe = kids.get(sc.SPAN_FRONTEND, [])
    assert len(q) == 1 and len(fe) <= 1
    if fe:  # the front end's own time, then the scheduler's queue
        assert fe[0].start_ns == root.start_ns and fe[0].end_ns == q[0].start_ns
    else:
        assert q[0].start_ns == root.start_ns
    if kids.get(sc.SPAN_PREFILL):
        (p,) = kids[sc.SPAN_PREFILL]
        assert q[0].end_ns <= p.start_ns
        if kids.get(sc.SPAN_DECODE):
            (d,) = kids[sc.SPAN_DECODE]
            assert p.end_ns <= d.start_ns
    offs = root.attributes[sc.TOKEN_EVENT_OFFSETS]
    toks = root.attributes[sc.TOKEN_EVENT_TOKENS]
    assert len(offs) == len(toks)
    assert offs == sorted(offs) and all(o >= 0 for o in offs)
    assert all(k >= 1 for k in toks)
    assert sum(toks) == root.attributes[sc.OUTPUT_TOKENS]
