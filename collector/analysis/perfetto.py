"""``otel-llm export --format perfetto``: a run as Chrome trace event JSON, which ui.perfetto.dev and
chrome://tracing open.

Process 1, "requests": one track (thread) per request, named by its request id, holding its client
span (send -> stream closed), its HTTP server span (first bytes read -> last chunk written), its
engine phases (front end, queue, prefill, decode) and its token events at each boundary as instants;
a disaggregated request's prefill engine's leg (category ``prefill engine``) before its decode
engine's phases, which then include its KV transfer and the step that took it up; a request
preempted is marked with an instant at its end carrying the count and the time. Process 2, "engine
steps": one track per engine process (``service.name``) with a slice per step (its batch size,
tokens, KV usage and preemptions as arguments) and counters for the batch size and the KV cache in
use.

Times are microseconds after the run's origin (the earliest client send), server and engine times
(one host) moved onto the client's clock by the clock offset ``compare`` estimates, as in the
report (:mod:`collector.analysis.report_data`).
"""

from __future__ import annotations

import numpy as np

from otel_llm.semconv import Boundary

from ..pipeline.records import RecordBatch
from ..pipeline.steps import StepBatch
from .compare import compare
from .report_data import request_units, waterfall_rows

REQUESTS_PID, STEPS_PID = 1, 2


def _us(s: float) -> float:
    return round(s * 1e6, 3)


def _request_events(rows: list) -> list[dict]:
    """Each waterfall row's track (a thread of the requests' process): its phases as slices, its
    token events and its preemptions as instants (µs after the origin)."""
    ev: list[dict] = []
    for tid, r in enumerate(rows, start=1):
        base = {"pid": REQUESTS_PID, "tid": tid}
        ev.append({**base, "ph": "M", "name": "thread_name", "args": {"name": r.id}})
        ev.append({**base, "ph": "M", "name": "thread_sort_index", "args": {"sort_index": tid}})

        def slice_(name, a, b, cat, args=None, base=base):
            if a is not None and b is not None and b >= a:
                ev.append(
                    {
                        **base,
                        "ph": "X",
                        "name": name,
                        "cat": cat,
                        "ts": _us(a),
                        "dur": _us(b - a),
                        **({"args": args} if args else {}),
                    }
                )

        slice_("client request", r.client_submit, r.client_end, "client", {"status": r.status})
        slice_("HTTP server", r.server_received, r.server_end, "server")
        slice_("prefill engine's leg", r.prefill_leg_start, r.prefill_leg_end, "prefill engine")
        slice_("front end", r.engine_arrival, r.queue_start, "engine")
        slice_("queue", r.queue_start, r.kv_start if r.kv_start is not None else r.first_scheduled, "engine")
        slice_("KV transfer", r.kv_start, r.kv_end, "engine")
        slice_("KV ready", r.kv_end, r.first_scheduled if r.kv_end is not None else None, "engine")
        slice_("prefill", r.first_scheduled, r.first_generated, "engine")
        slice_("decode", r.first_generated, r.engine_end, "engine")
        tokens = (("token (client)", r.client_tokens), ("token (server)", r.server_tokens))
        for name, times in (*tokens, ("token (engine)", r.engine_tokens)):
            for t in times:
                ev.append({**base, "ph": "i", "s": "t", "name": name, "cat": "token", "ts": _us(t)})
        if r.preemptions:
            ev.append(
                {
                    **base,
                    "ph": "i",
                    "s": "t",
                    "name": "preempted",
                    "cat": "engine",
                    "ts": _us(r.engine_end or 0.0),
                    "args": {"preemptions": r.preemptions, "preempted_s": r.preemption_time},
                }
            )
    return ev


def _step_events(steps: StepBatch, origin: int, theta_ns: int) -> list[dict]:
    """The engine's steps: one track per service in the steps' process, a slice per step and its
    batch size and KV usage as counters (µs after the origin, on the client's clock)."""
    ev: list[dict] = []
    services = sorted({s or "engine" for s in steps.service})
    tids = {s: i for i, s in enumerate(services, start=1)}
    for s, tid in tids.items():
        ev.append({"ph": "M", "pid": STEPS_PID, "tid": tid, "name": "thread_name", "args": {"name": s}})
    start = (steps.start_ns - theta_ns - origin) / 1e9
    dur = (steps.end_ns - steps.start_ns) / 1e9
    kv = steps.kv_usage
    for i in range(len(steps)):
        tid = tids[steps.service[i] or "engine"]
        args = {
            "index": int(steps.step_index[i]),
            "batch_size": int(steps.batch_size[i]),
            "prefill_tokens": int(steps.prefill_tokens[i]),
            "decode_tokens": int(steps.decode_tokens[i]),
            "preempted": int(steps.preempted[i]),
        }
        if np.isfinite(kv[i]):
            args["kv_usage"] = float(kv[i])
        if steps.draft_tokens[i] >= 0:  # speculative decoding: the drafts it verified, those accepted
            args["draft_tokens"] = int(steps.draft_tokens[i])
            args["accepted_tokens"] = int(steps.accepted_tokens[i])
        ts = _us(float(start[i]))
        ev.append(
            {
                "ph": "X",
                "pid": STEPS_PID,
                "tid": tid,
                "name": "step",
                "cat": "step",
                "ts": ts,
                "dur": _us(float(dur[i])),
                "args": args,
            }
        )
        counters = {"batch size": args["batch_size"]}
        if "kv_usage" in args:
            counters["KV usage"] = args["kv_usage"]
        ev.append({"ph": "C", "pid": STEPS_PID, "tid": tid, "name": "engine", "ts": ts, "args": counters})
    return ev


def trace_events(batch: RecordBatch, steps: StepBatch | None) -> dict:
    """The Chrome trace event document of the records and steps."""
    records = batch.records()
    if not records:
        raise ValueError("no records to export")
    client = [r for r in records if r.boundary == Boundary.CLIENT]
    origin = min(r.submit_ns for r in (client or records))
    cmp = compare(records, None)
    theta_ns = round(cmp.offset.theta * 1e9)
    units = request_units(records, cmp)
    rows = waterfall_rows(units, origin, theta_ns, slowest=len(units), sample=0)
    rows.sort(key=lambda r: r.client_submit if r.client_submit is not None else (r.engine_arrival or 0.0))
    ev: list[dict] = [
        {"ph": "M", "pid": REQUESTS_PID, "name": "process_name", "args": {"name": "requests"}},
        {"ph": "M", "pid": REQUESTS_PID, "name": "process_sort_index", "args": {"sort_index": 1}},
    ]
    ev += _request_events(rows)
    if steps is not None and len(steps):  # (no empty process without them: steps need OTEL_LLM_DETAIL=steps)
        ev += [
            {"ph": "M", "pid": STEPS_PID, "name": "process_name", "args": {"name": "engine steps"}},
            {"ph": "M", "pid": STEPS_PID, "name": "process_sort_index", "args": {"sort_index": 2}},
        ]
        ev += _step_events(steps, origin, theta_ns)
    return {
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {
            "origin_unix_ns": origin,
            "clock_offset_s": cmp.offset.theta,
            "generated_by": "otel-llm export --format perfetto",
        },
    }
