"""One bench run as a sweep point sees it, from the collector's records and steps: each
boundary's summary, the client TTFT in its parts, the engine's state during the run, the stalls.

What ``otel-llm bench --sweep`` / ``--find-capacity`` add to each point (through the entry point
``otel_llm.run_profiles: store``, :func:`profile_from_store`) and what ``otel-llm report`` plots
against load (:func:`profile_run`): one function serves both. Pure over the records; JSON-ready
dicts. Units: seconds, fractions, counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from otel_llm.metrics.fluidity import FluidityTarget
from otel_llm.metrics.selection import Selection
from otel_llm.metrics.slo import SLO
from otel_llm.metrics.summary import summarize
from otel_llm.metrics.timeline import BOUNDARIES
from otel_llm.semconv import Boundary, RequestStatus

from ..pipeline.records import RecordBatch
from ..pipeline.stalls import ALL_CLASSES
from ..pipeline.steps import StepBatch
from .compare import compare, summarize_comparison


def decomposition(batch: RecordBatch, steps: StepBatch | None) -> dict | None:
    """The mean client TTFT of the run's paired ok requests whose parts are all known, and each
    part's mean (seconds; the means add up to the mean TTFT) and share of it. None without pairs."""
    cmp = compare(batch.records(), None, steps=steps)
    known = [
        r for r in cmp.rows if r.status == RequestStatus.OK and r.parts_sum_minus_ttft is not None and r.client_ttft
    ]
    if not known:
        return None
    share = summarize_comparison(cmp).ttft_share or {}
    ttft = sum(r.client_ttft for r in known) / len(known)
    return {
        "requests": len(known),
        "ttft_mean_s": ttft,
        "parts_mean_s": {k: (None if v is None else v * ttft) for k, v in share.items()},
        "share": share,
        "stalls": {k: sum(1 for r in cmp.rows if r.stall == k) for k in ALL_CLASSES},
    }


def engine_state(engine: RecordBatch, steps: StepBatch | None) -> dict | None:
    """The engine's steps from the run's first engine arrival to its last engine end (steps of
    other work in that time count too): batch size, KV cache usage, preemptions."""
    if not len(engine):
        return None
    out: dict = {
        "requests_preempted": int((engine.preemptions > 0).sum()),
        "preemptions": int(np.maximum(engine.preemptions, 0).sum()),  # -1: not said (another source)
    }
    if steps is None or not len(steps):
        return out
    t0, t1 = int(engine.submit_ns.min()), int(engine.end_ns.max())
    inside = np.flatnonzero((steps.start_ns >= t0) & (steps.start_ns <= t1))
    if not len(inside):
        return out
    s = steps.take(inside)
    bs = s.batch_size[s.batch_size >= 0]
    kv = s.kv_usage[np.isfinite(s.kv_usage)]
    busy = float((s.end_ns - s.start_ns).sum()) / max(t1 - t0, 1)
    out.update(
        steps=len(s),
        busy_fraction=busy,  # step time / the run's engine span: near 1, the engine never waited for work
        batch_size_mean=float(bs.mean()) if len(bs) else None,
        batch_size_max=int(bs.max()) if len(bs) else None,
        kv_usage_mean=float(kv.mean()) if len(kv) else None,
        kv_usage_max=float(kv.max()) if len(kv) else None,
        preempted_in_steps=int(s.preempted[s.preempted > 0].sum()),
    )
    said = s.waiting >= 0
    if said.any():  # the engine says how many waited after each step, and why
        w = s.waiting[said]
        reasons = [r for r, k in zip(s.wait_reason, said.tolist()) if k and r]
        out["waiting_mean"] = float(w.mean())
        out["steps_with_waiting"] = float((w > 0).mean())  # share of the steps
        out["wait_reasons"] = {r: reasons.count(r) / len(w) for r in sorted(set(reasons))}  # share of the steps
    return out


def profile_run(
    batch: RecordBatch,
    steps: StepBatch | None,
    run_id: str,
    slo: SLO | None = None,
    fluidity: FluidityTarget | None = None,
    ps: Sequence[str] = ("50", "90", "99"),
) -> dict:
    """The run ``run_id`` of ``batch`` (warm-ups left out): records per boundary, each boundary's
    summary (:meth:`Summary.to_json`), ``decomposition``, ``engine``."""
    run = batch.selected(Selection(runs=(run_id,)))
    out: dict = {"run_id": run_id, "records": {}, "boundaries": {}}
    for b in BOUNDARIES:
        part = run.at_boundary(b)
        out["records"][b] = len(part)
        if len(part):
            tb = part.timelines(epoch_ns=0)
            out["boundaries"][b] = summarize(tb, slo=slo, ps=ps, fluidity=fluidity).to_json()
    out["decomposition"] = decomposition(run, steps) if len(run) else None
    out["engine"] = engine_state(run.at_boundary(Boundary.ENGINE), steps)
    return out


def profile_from_store(
    path: str | Sequence[str],
    run_id: str,
    slo: SLO | None = None,
    fluidity: FluidityTarget | None = None,
    ps: Sequence[str] = ("50", "90", "99"),
) -> dict:
    """Entry point ``otel_llm.run_profiles: store``: :func:`profile_run` over a store (or several)."""
    from ..storage.store import read_stores

    batch, steps = read_stores(path)
    return profile_run(batch, steps, run_id, slo, fluidity, ps)


def records_of_run(path: str | Sequence[str], run_id: str) -> dict[str, int]:
    """Entry point ``otel_llm.run_profiles: store_counts``: how many records of ``run_id`` (warm-ups
    left out) a store holds at each boundary (a sweep waits for them before profiling a point)."""
    from ..storage.store import open_existing, store_paths

    out = dict.fromkeys(BOUNDARIES, 0)
    for p in store_paths(path):  # a count in SQL: the sweep asks every half second
        s = open_existing(p)
        try:
            for b, n in s.run_counts(run_id).items():
                out[b] = out.get(b, 0) + n
        finally:
            s.close()
    return out
