"""``otel-llm bench --sweep`` and ``--find-capacity``: one bench run per load point.

Each point is a whole run of its own (its run id ``<base>-<knob><value>``, its warm-up, its
window, its conditions and its ``llm.bench.run`` span), measured at the client and, with
``--store``, profiled from the collector's store at every boundary (through the entry point
``otel_llm.run_profiles``, :mod:`collector.analysis.run_profile`). The search itself is
:class:`otel_llm.bench.capacity.CapacitySearch`; definitions in docs/metrics/capacity.md.

Results: a table (one row per point, then the answer), ``--format json`` (one document), and
``--results FILE``: JSON lines, one object per point as it completes (``"kind": "point"``), then
one ``"kind": "capacity"`` or ``"kind": "sweep"`` object with the conclusion.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from importlib.metadata import entry_points

from ..cli_options import CLIError, fluidity_option, slo_option
from ..metrics.summary import summarize
from ..metrics.timeline import TimelineBatch
from .capacity import (
    CapacitySearch,
    Sweep,
    first_failed_bound,
    keeping_up,
    part_that_grew,
    requests_per_point,
    wilson,
)
from .load import LoadSpec, measured


def run_profiler(name: str):
    """The ``otel_llm.run_profiles`` entry point ``name`` (the collector package's)."""
    for ep in entry_points(group="otel_llm.run_profiles"):
        if ep.name == name:
            return ep.load()
    raise CLIError("--store needs the collector package (entry point otel_llm.run_profiles is missing)")


class Sweeper:
    """Runs points and keeps what each gave. ``run_point(spec)`` is bench's own run of one spec;
    it returns (run, conditions)."""

    def __init__(self, args: argparse.Namespace, base: LoadSpec, run_point):
        self.args, self.base, self.run_point = args, base, run_point
        self.slo = slo_option(args.slo, args.tpot_undefined)
        self.fluidity = fluidity_option(args.fluidity)
        self.points: list[dict] = []
        self.results = open(args.results, "w") if args.results else None  # noqa: SIM115 (closed in close())
        self.interrupted = False
        self.aborted: str | None = None  # a point whose requests all failed stops the sweep
        if args.store:
            self.profile = run_profiler("store")
            self.counts = run_profiler("store_counts")

    def close(self, conclusion: dict | None) -> None:
        if self.results:
            if conclusion is not None:
                self.results.write(json.dumps(conclusion) + "\n")
            self.results.close()

    def measure(self, knob: str, value: float, label: str, judge=None) -> dict:
        """Run one point and describe it (client summary, attainment over requests sent, profile);
        ``judge(point)`` adds its verdict before the point is written out."""
        args = self.args
        changes = {"run_id": f"{self.base.run_id}-{label}"}
        if knob == "rate":
            changes.update(rate=value, concurrency=None)
            at_least = math.ceil(value * args.min_point_duration)
            if self.base.num_requests is not None and at_least > self.base.num_requests:
                changes["num_requests"] = at_least
        else:
            changes.update(concurrency=int(value), rate=None, max_concurrency=None)
        spec = dataclasses.replace(self.base, **changes)
        print(f"bench: point {len(self.points) + 1}: {knob} {value:g} (run {spec.run_id})", file=sys.stderr)
        run, cond = self.run_point(spec)
        self.interrupted = run.interrupted
        self.aborted = run.aborted
        if run.aborted:
            print(f"bench: point {len(self.points) + 1} stopped: {run.aborted}", file=sys.stderr)
        ms = measured(run)
        sent_in_run = len(ms)  # what the store will hold of the run, settling requests included
        steady = None
        if knob == "rate" and len(ms) > 1:  # ms is in order of sending
            sends = [s.result.submit_ns / 1e9 for s in ms]
            start = sends[0] + args.settle * (sends[-1] - sends[0])  # the point's settling time is left out
            steady = keeping_up(sends, [s.result.end_ns / 1e9 for s in ms], start, sends[-1] + 1e-9, args.confidence)
            ms = [s for s, t in zip(ms, sends) if t >= start]
        batch = TimelineBatch.from_timelines([s.result.timeline() for s in ms])
        ps = args.percentiles
        summary = summarize(batch, slo=self.slo, ps=ps, method=args.percentile_method, fluidity=self.fluidity)
        point = {"kind": "point", "index": len(self.points), knob: value, "run_id": spec.run_id}
        point["conditions"] = cond
        point["client"] = summary.to_json()
        if steady is not None:
            point["steady_state"] = steady.to_json()
        if summary.goodput is not None:
            good, sent = summary.goodput.good, len(ms)
            point["attainment_of_sent"] = good / sent if sent else None
            iv = wilson(good, sent, args.confidence)
            point["attainment_interval"] = list(iv) if iv else None
            point["attainment_by_bound"] = summary.goodput.attainment_by_bound
        if args.store and ms:
            point["profile"] = self._profile(spec.run_id, sent_in_run)
        if judge is not None:
            judge(point)
        self.points.append(point)
        if self.results:
            self.results.write(json.dumps(point) + "\n")
            self.results.flush()
        return point

    def _profile(self, run_id: str, sent: int) -> dict | None:
        """Wait (at most ``--store-wait`` s) until the store holds the point's client records and its
        engine record count has stopped growing, then profile the run from it."""
        deadline = time.monotonic() + self.args.store_wait
        last = None
        while True:
            try:
                counts = self.counts(self.args.store, run_id)
            except (OSError, ValueError) as exc:
                counts = {"error": str(exc)}
            settled = counts.get("client", 0) >= sent and counts == last
            if settled or time.monotonic() >= deadline:
                break
            last = counts
            time.sleep(0.5)
        if not settled:
            print(f"bench: the store held {counts} of run {run_id} after {self.args.store_wait:g} s", file=sys.stderr)
        try:
            return self.profile(self.args.store, run_id, self.slo, self.fluidity, self.args.percentiles)
        except (OSError, ValueError) as exc:
            print(f"bench: no profile of run {run_id} from the store: {exc}", file=sys.stderr)
            return None


# -- what a point says ----------------------------------------------------------------------------


def _pct(point: dict, metric: str, p: str) -> float | None:
    return (point["client"]["latency"].get(metric) or {}).get(f"p{p}")


def parts_of_point(point: dict) -> dict[str, float] | None:
    d = (point.get("profile") or {}).get("decomposition")
    return None if d is None else {k: v for k, v in d["parts_mean_s"].items() if v is not None}


def what_grew(low: dict, high: dict, knob: str) -> str:
    """Which part of the client's time grew from point ``low`` to point ``high`` (words)."""
    a, b = parts_of_point(low), parts_of_point(high)
    if a and b:
        grew = part_that_grew(a, b)
        if grew:
            part, d = grew
            sa = low["profile"]["decomposition"]["share"].get(part) or 0.0
            sb = high["profile"]["decomposition"]["share"].get(part) or 0.0
            ta = low["profile"]["decomposition"]["ttft_mean_s"]
            tb = high["profile"]["decomposition"]["ttft_mean_s"]
            return (
                f"from {knob} {low[knob]:g} to {high[knob]:g} the mean client TTFT went from {ta * 1e3:.1f} to "
                f"{tb * 1e3:.1f} ms; the part that grew most is {part}: +{d * 1e3:.1f} ms, "
                f"{sa:.0%} -> {sb:.0%} of it"
            )
    t0, t1 = _pct(low, "ttft", "50"), _pct(high, "ttft", "50")
    p0, p1 = _pct(low, "tpot", "50"), _pct(high, "tpot", "50")
    words = []
    if t0 is not None and t1 is not None:
        words.append(f"client TTFT p50 {t0 * 1e3:.1f} -> {t1 * 1e3:.1f} ms")
    if p0 is not None and p1 is not None:
        words.append(f"TPOT p50 {p0 * 1e3:.2f} -> {p1 * 1e3:.2f} ms")
    why = " (the parts need --store: the collector's records of the engine)"
    return f"from {knob} {low[knob]:g} to {high[knob]:g}: " + ", ".join(words) + why if words else "nothing to compare"


def conclude_capacity(search: CapacitySearch, points: list[dict], args: argparse.Namespace) -> dict:
    by_rate = {p["rate"]: p for p in points}
    cap, hi = search.capacity, search.lowest_failing
    out = {
        "kind": "capacity",
        "slo": slo_option(args.slo, args.tpot_undefined).bounds,
        "attainment_target": args.attainment,
        "capacity_rate_per_s": cap,
        "lowest_failing_rate_per_s": hi,
        "stopped": search.stopped,
        "resolution": args.resolution,
        "points": len(points),
        "min_requests_per_point": args.points_requests,
        "min_point_duration_s": args.min_point_duration,
        "settle": args.settle,
        "capacity_is_lower_bound": hi is None and cap is not None,
        "attainment_error": args.points_error,
        "confidence": args.confidence,
        "marginal_points": [p.rate for p in search.points if not p.clear],
    }
    ff = first_failed_bound(
        [{"rate": p["rate"], "by_bound": p.get("attainment_by_bound")} for p in points], args.attainment
    )
    out["first_failed_bound"] = None if ff is None else {"rate": ff[0], "bounds": ff[1]}
    if hi is not None:
        low = by_rate[min(by_rate)]
        out["why"] = what_grew(low, by_rate[hi], "rate") if low is not by_rate[hi] else "the first point failed"
        waits = (((by_rate[hi].get("profile") or {}).get("engine")) or {}).get("wait_reasons")
        if waits:  # what the engine says held requests back at the first failing rate
            reason, share = max(waits.items(), key=lambda kv: kv[1])
            out["waiting_at_knee"] = {"reason": reason, "share_of_steps": share, "all": waits}
            out["why"] += f"; at {hi:g} req/s requests waited after {share:.0%} of the engine's steps: {reason}"
    return out


def conclude_sweep(sweep: Sweep, points: list[dict], args: argparse.Namespace) -> dict:
    out: dict = {"kind": "sweep", "knob": sweep.knob, "values": list(sweep.values), "points": len(points)}
    if args.slo:
        ff = first_failed_bound(
            [{"rate": p[sweep.knob], "by_bound": p.get("attainment_by_bound")} for p in points], args.attainment
        )
        out["first_failed_bound"] = None if ff is None else {sweep.knob: ff[0], "bounds": ff[1]}
    if len(points) > 1:
        out["why"] = what_grew(points[0], points[-1], sweep.knob)
    return out


def steady_words(st: dict | None) -> str:
    """A point's steady state in words: offered and completed rates, the number in flight."""
    if st is None:
        return "steady state unknown (too few requests)"
    verdict = "kept up" if st["keeps_up"] else "FELL BEHIND"
    return (
        f"{verdict}: offered {st['offered_per_s']:.3g}/s, completed {st['completed_per_s']:.3g}/s "
        f"(+-{st['tolerance_per_s']:.2g}), in flight {st['in_flight_start']} -> {st['in_flight_end']} "
        f"(growth {st['growth']:+.3g}, at most {st['growth_tolerance']:.3g}) over {st['window_s']:.3g} s"
    )


# -- the table -----------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _frac(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _fluid_rate(fl: dict) -> str:
    r = fl.get("fluid_token_rate_per_s") if fl else None
    return "-" if r is None else (r if isinstance(r, str) else f"{r:.0f}")


def point_row(p: dict, knob: str) -> list[str]:
    c = p["client"]
    g = c.get("goodput") or {}
    prof = p.get("profile") or {}
    dec, eng = prof.get("decomposition") or {}, prof.get("engine") or {}
    share = dec.get("share") or {}
    iv = p.get("attainment_interval")
    fl = c.get("fluidity") or {}
    st = p.get("steady_state")
    return [
        f"{p[knob]:g}",
        f"{p['conditions'].get('achieved_arrival_rate_per_s') or 0:.3g}",
        "-" if st is None else f"{st['completed_per_s']:.3g}",
        "-" if st is None else f"{st['in_flight_start']}->{st['in_flight_end']}",
        "-" if st is None else ("yes" if st["keeps_up"] else "NO"),
        str(c["counts"]["requests"]),
        _frac(c["throughput"]["requests_per_s"]) if c["throughput"]["requests_per_s"] else "-",
        f"{c['throughput']['output_tokens_per_s'] or 0:.0f}",
        _ms(_pct(p, "ttft", "50")),
        _ms(_pct(p, "ttft", "99")),
        _ms(_pct(p, "tpot", "50")),
        _ms(_pct(p, "tpot", "99")),
        _frac(g.get("requests_per_s")),
        (_frac(p.get("attainment_of_sent")) + (f" [{iv[0]:.2f},{iv[1]:.2f}]" if iv else "")) if g else "-",
        _fluid_rate(fl),
        _frac(share.get("queue")),
        _frac(share.get("prefill")),
        _frac(eng.get("batch_size_mean")),
        _frac(eng.get("kv_usage_max")),
        str(eng.get("preemptions", "-")),
    ]


HEADER = [
    "req/s sent",
    "achieved",
    "completed",
    "in flight",
    "kept up",
    "requests",
    "req/s done",
    "tok/s",
    "TTFT p50 ms",
    "p99",
    "TPOT p50 ms",
    "p99",
    "goodput",
    "attainment (sent) [CI]",
    "fluid tok/s",
    "queue",
    "prefill",
    "batch",
    "KV max",
    "preempt",
]


def table(points: list[dict], knob: str) -> str:
    head = list(HEADER)
    head[0] = "req/s sent" if knob == "rate" else "concurrency"
    rows = [head] + [point_row(p, knob) for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows) + "\n"


def conclusion_text(c: dict) -> str:
    lines = []
    if c["kind"] == "capacity":
        slo = ",".join(f"{k}={v:g}" for k, v in c["slo"].items())
        if c["capacity_rate_per_s"] is None:
            lines.append(f"capacity: below {c['lowest_failing_rate_per_s']:g} req/s (no measured rate met the SLO)")
        elif c["lowest_failing_rate_per_s"] is None:
            ceiling = " (the search's ceiling, --max-rate)" if c["stopped"] == "passed at max rate" else ""
            lines.append(
                f"capacity: at least {c['capacity_rate_per_s']:g} req/s{ceiling} at {c['attainment_target']:.0%} of "
                f"requests within {slo}: no measured rate failed; stopped: {c['stopped']} ({c['points']} points)"
            )
        else:
            hi = c["lowest_failing_rate_per_s"]
            above = f"; {hi:g} req/s failed"
            lines.append(
                f"capacity: {c['capacity_rate_per_s']:g} req/s at {c['attainment_target']:.0%} of requests within "
                f"{slo}{above}; stopped: {c['stopped']} (resolution {c['resolution']:.0%}, {c['points']} points)"
            )
        lines.append(
            f"each point: at least {c['min_requests_per_point']} requests"
            + (f" and {c['min_point_duration_s']:g} s of sending" if c["min_point_duration_s"] else "")
            + (f", its first {c['settle']:.0%} left out to settle" if c.get("settle") else "")
            + f", attainment known within +-{c['attainment_error']:.3f} "
            f"at {c['confidence']:.0%} (Wilson, independent requests assumed)"
            + (
                f"; marginal (interval holds the target): {', '.join(f'{r:g}' for r in c['marginal_points'])}"
                if c["marginal_points"]
                else ""
            )
        )
    ff = c.get("first_failed_bound")
    if ff:
        where = {k: v for k, v in ff.items() if k != "bounds"}
        ((k, v),) = where.items()
        lines.append(f"first bound to fail: {', '.join(ff['bounds'])} (at {k} {v:g})")
    if c.get("why"):
        lines.append("why: " + c["why"])
    return "\n".join(lines) + "\n"


# -- the two modes -------------------------------------------------------------------------------


def run_sweep(sweeper: Sweeper, sweep: Sweep) -> dict:
    for v in sweep.values:
        sweeper.measure(sweep.knob, v, sweep.label(v))
        if sweeper.interrupted or sweeper.aborted:
            break
    return conclude_sweep(sweep, sweeper.points, sweeper.args)


def run_capacity(sweeper: Sweeper, search: CapacitySearch) -> dict:
    args = sweeper.args

    def judge(p: dict) -> None:
        a = p.get("attainment_of_sent")
        iv = p.get("attainment_interval")
        met = a is not None and a >= args.attainment
        st = p.get("steady_state")
        kept = st is None or st["keeps_up"]
        pt = search.record(p["rate"], met and kept, a, tuple(iv) if iv else None)
        p["passed"], p["clear"] = pt.passed, pt.clear
        if not kept:
            p["clear"] = pt.clear = True  # falling behind is not a matter of the attainment's interval
        print(
            f"bench: {pt.rate:g} req/s: attainment {a if a is None else round(a, 3)} "
            f"{'>=' if met else '<'} {args.attainment:g}; " + steady_words(st) + f": {'pass' if pt.passed else 'fail'}"
            f"{'' if pt.clear else ' (marginal)'}",
            file=sys.stderr,
        )

    while (rate := search.next_rate()) is not None:
        sweeper.measure("rate", rate, f"rate{rate:g}", judge)
        if sweeper.interrupted or sweeper.aborted:
            search.stopped = "interrupted" if sweeper.interrupted else "every request failed"
            break
    return conclude_capacity(search, sweeper.points, args)


def points_size(args: argparse.Namespace) -> tuple[int | None, float | None]:
    """For --find-capacity: (requests per point, attainment error) from --num-requests or
    --attainment-error (None, None with --duration: the count is what the time gives)."""
    from .capacity import wilson_half_width

    if args.duration:
        return None, None
    if args.num_requests:
        return args.num_requests, wilson_half_width(args.attainment, args.num_requests, args.confidence)
    return requests_per_point(args.attainment, args.attainment_error, args.confidence), args.attainment_error


def print_results(args: argparse.Namespace, knob: str, points: list[dict], conclusion: dict) -> None:
    if args.format == "json":
        sys.stdout.write(json.dumps({"points": points, "conclusion": conclusion}, indent=2) + "\n")
        return
    title = "Capacity search" if conclusion["kind"] == "capacity" else f"Sweep over {knob}"
    sys.stdout.write(f"== {title} ==\n")
    sys.stdout.write(table(points, knob))
    note = "achieved: requests/s sent; completed: requests/s that ended, in flight: sent and not ended (both over "
    note += "the point's window after it settled); queue, prefill: shares of the mean client TTFT; "
    note += "batch: mean requests per step; KV max: fraction"
    if not args.store:
        note += " (engine columns need --store)"
    elif not any(((p.get("profile") or {}).get("engine") or {}).get("steps") for p in points):
        note += " (batch and KV need the engine's step spans: OTEL_LLM_DETAIL=steps where the engine runs)"
    sys.stdout.write(note + "\n\n" + conclusion_text(conclusion))
    if args.results:
        print(f"results written to {args.results}")
