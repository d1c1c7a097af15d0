"""Requests through the generic hook API, as an engine's adapter records them (the span process's
tests, in this process and in the scripts they start)."""

from __future__ import annotations

import numpy as np

from engine_hooks import EngineHooks
from otel_llm import semconv as sc

#: a caller's W3C trace context: the requests whose id ends in 0 join its trace
TRACEPARENT = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


def feed(hooks: EngineHooks, n: int, start: int = 0) -> None:
    """``n`` requests through the generic hooks: arrival, a schedule and steps, tokens, finish."""
    arrive = hooks.arrival(
        request_id=lambda res, rid: rid,
        input_tokens=lambda res, rid: 4,
        trace_headers=lambda res, rid: TRACEPARENT if rid.endswith("0") else None,
        attributes=lambda res, rid: {sc.REQUEST_MODEL: "tiny", "llm.test.np": np.int64(7)},
    )(lambda rid: None)
    sched = hooks.schedule(scheduled=lambda res, *a: res)(lambda ids=(): list(ids))
    step = hooks.step(batch_size=lambda res, plan: len(plan), tokens=lambda res, plan: (0, len(plan)))
    step = step(lambda plan: plan)
    out = hooks.token_out(outputs=lambda res, ids: [(r, 1) for r in ids])(lambda ids: None)
    pre = hooks.preempt(request_id=lambda res, rid: rid)(lambda rid: None)
    fin = hooks.finish(request_id=lambda res, ids: ids)(lambda ids: None)
    ids = [f"r{i}" for i in range(start, start + n)]
    for rid in ids:
        arrive(rid)
    plan = sched(ids)
    for _ in range(3):
        out(step(plan))
        plan = sched([])
    pre(ids[0])
    out(step(sched([ids[0]])))
    fin(ids)
