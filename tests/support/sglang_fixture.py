"""Spans in exactly the shape SGLang's own tracing sends them (``--enable-trace``), built through the
OpenTelemetry SDK as SGLang builds them: SGLang cannot run on these machines, so its shapes are
taken from its source (``python/sglang/srt/tracing/trace.py``: ``trace_req_start`` /
``__create_thread_context`` / ``trace_slice_start`` / ``trace_slice_end`` / ``trace_req_finish``;
``trace_metric_wrapper.py``: the stage names and their levels).

One request: a root ``Req <rid[:8]>`` (attributes ``rid``, ``bootstrap_room``), a tokenizer thread
span and a scheduler thread span under it (``<label> [TP n] (host:<8> | pid:<pid>)``, attributes
``host_id``, ``pid``, ``thread_label``, ``tp_rank``), and the stage spans of ``level`` under those,
each linked to the one before it on its thread, as SGLang links them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry import trace

MS = 1_000_000
HOST = "0f3c9a7e5b2d4c1a8e6f0b9d7c5a3e1f"
LEVEL = {  # trace_metric_wrapper.RequestStage
    "tokenize": 1,
    "dispatch": 2,
    "request_process": 1,
    "prefill_waiting": 1,
    "prefill_forward": 1,
    "chunked_prefill": 3,
    "decode_loop": 2,
}


@dataclass
class SGLangRequest:
    """One request's times, ms after ``t0``."""

    rid: str
    tokenize: tuple = (0.2, 2.0)
    dispatch: tuple = (2.0, 3.0)
    request_process: tuple = (3.5, 4.0)
    prefill_waiting: tuple = (4.0, 10.0)
    prefill_forward: tuple = (10.0, 30.0)
    chunks: list = field(default_factory=lambda: [(10.0, 20.0), (20.0, 30.0)])  # chunked_prefill, in prefill_forward
    decode_ends: list = field(default_factory=lambda: [35.0, 40.0, 45.0, 80.0, 85.0])  # one decode_loop each
    finish: float = 86.0


def emit(tracer, r: SGLangRequest, t0_ns: int, level: int, context=None) -> None:
    """The spans SGLang's tracing sends for ``r`` at trace level ``level``. ``context``: where the
    root goes (SGLang inherits the HTTP server's context; a client's traceparent through it)."""
    t = lambda ms: t0_ns + int(ms * MS)
    root = tracer.start_span(f"Req {r.rid.split('_')[-1][:8]}", start_time=t(0), context=context)
    root.set_attributes({"rid": r.rid, "bootstrap_room": "None"})
    rctx = trace.set_span_in_context(root)

    def thread(label: str, pid: int, tp_rank: int | None):
        name = label + (f" [TP {tp_rank}] " if tp_rank is not None else "") + f"(host:{HOST[:8]} | pid:{pid})"
        s = tracer.start_span(name, start_time=t(0), context=rctx)
        if tp_rank is not None:
            s.set_attributes({"tp_rank": tp_rank})
        s.set_attributes({"host_id": HOST, "pid": pid, "thread_label": label})
        return s

    last = {}

    def stage(th, name: str, begin: float, end: float, parent=None):
        if LEVEL[name] > level:
            return None
        s = tracer.start_span(name, start_time=t(begin), context=trace.set_span_in_context(parent or th))
        if parent is None and th in last:
            s.add_link(last[th].get_span_context())
        s.end(end_time=t(end))
        if parent is None:
            last[th] = s
        return s

    tok = thread("Tokenizer", 4101, None)
    stage(tok, "tokenize", *r.tokenize)
    stage(tok, "dispatch", *r.dispatch)
    sch = thread("Scheduler", 4202, 0)
    stage(sch, "request_process", *r.request_process)
    stage(sch, "prefill_waiting", *r.prefill_waiting)
    if LEVEL["prefill_forward"] <= level:
        fwd = tracer.start_span(
            "prefill_forward", start_time=t(r.prefill_forward[0]), context=trace.set_span_in_context(sch)
        )
        if sch in last:
            fwd.add_link(last[sch].get_span_context())
        for c in r.chunks:
            stage(sch, "chunked_prefill", *c, parent=fwd)
        fwd.end(end_time=t(r.prefill_forward[1]))
        last[sch] = fwd
    begin = r.prefill_forward[1]
    for end in r.decode_ends:
        stage(sch, "decode_loop", begin, end)
        begin = end
    for th in (tok, sch):
        th.end(end_time=t(r.finish))
    root.end(end_time=t(r.finish))
