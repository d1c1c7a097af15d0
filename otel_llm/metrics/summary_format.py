"""Formatting a :class:`~otel_llm.metrics.summary.Summary` for people (table, markdown) or tools (JSON).

JSON is in seconds throughout; the table and markdown show milliseconds, with the percentile method,
sample count and population next to every percentile.
"""

from __future__ import annotations

import json

from .selection import iso
from .summary import Summary

FORMATS = ("table", "json", "markdown")
LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "itl_max": "ITL max", "e2e": "E2E"}
UNITS = {"tpot": "ms/token"}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.2f}"


def _num(v: float | None, spec: str = ".3f") -> str:
    return "undefined" if v is None else format(v, spec)


def _pct(v: float | None) -> str:
    return "undefined" if v is None else f"{v * 100:.1f}%"


def format_json(s: Summary) -> str:
    return json.dumps(s.to_json(), indent=2)


def _lines(s: Summary, markdown: bool) -> list[str]:
    w = s.window
    h = (lambda t: f"### {t}") if markdown else (lambda t: f"== {t} ==")
    if w.on_unix_clock:  # a store or a trace file: times people can read
        edges = f"{iso(w.start)} to {iso(w.end)}"
    else:  # timelines on their own clock
        edges = f"[{w.start:.6f}, {w.end:.6f}] s"
    out = [
        h("Window"),
        f"{edges}, T = {w.seconds:.3f} s ({'given' if w.explicit else 'earliest submit to latest end'})",
        "",
    ]
    for section in (_throughput_lines, _latency_lines, _goodput_lines, _fluidity_lines):
        out += section(s, h, markdown)
    return out


def _throughput_lines(s: Summary, h, markdown: bool) -> list[str]:
    """The counts, the rates, what sampling and the timelines leave unknown."""
    c = s.counts
    out: list[str] = []
    out.append(h("Throughput"))
    out.append(
        f"requests: {c.requests} in data; completed {c.completed}, failed {c.failed}, "
        f"cancelled {c.cancelled}, rejected {c.rejected} (end in window)"
    )
    out.append(
        f"request throughput: {_num(s.requests_per_s)} requests/s   "
        f"output token throughput: {_num(s.output_tokens_per_s, '.1f')} tokens/s "
        f"({s.output_tokens_in_window:.0f} tokens in window, all statuses)"
    )
    if s.sampling is not None:
        sm = s.sampling
        out.append(
            f"sampled: {sm['sampled_requests']} requests stand for {sm['estimated_requests']:.0f} (each counts for "
            f"1 / its sampling probability, the smallest {sm['smallest_probability']:.3g}): the rates, goodput and "
            "token counts are estimates; the request counts and latency distributions are the sample's"
        )
    out.append(
        f"TPOT undefined (N <= 1): {c.tpot_undefined}   no token: {c.no_token}   "
        f"events with >1 token (gaps inside unknown): {c.multi_token_events}"
        + (f"   first and last token only (no ITL): {c.summarised}" if c.summarised else "")
        + (f"   token count unknown (not counted; TPOT unknown): {c.tokens_unknown}" if c.tokens_unknown else "")
    )
    if s.violations is not None:
        v = dict(s.violations)
        n = v.pop("records", 0)
        kinds = ", ".join(f"{k} {m}" for k, m in v.items())
        out.append(f"timeline violations: {f'{n} records ({kinds}; otel-llm compare lists them)' if n else 'none'}")
    out.append("")
    return out


def _latency_lines(s: Summary, h, markdown: bool) -> list[str]:
    """Each latency metric: n, mean, the percentiles, max and its population (ms)."""
    out: list[str] = []
    pkeys = next(iter(s.latency.values())).percentiles.keys() if s.latency else []
    out.append(h(f"Latency (ms; percentiles by {s.percentile_method})"))
    cols = ["metric", "n", "mean", *pkeys, "max", "population"]
    rows = []
    for k, d in s.latency.items():
        name = LABELS[k] + (f" ({UNITS[k]})" if k in UNITS else "")
        rows.append([name, str(d.n), _ms(d.mean), *(_ms(d.percentiles[p]) for p in pkeys), _ms(d.max), d.population])
    out.extend(grid(cols, rows, markdown))
    out.append("")
    return out


def _goodput_lines(s: Summary, h, markdown: bool) -> list[str]:
    """Goodput under the SLO, where one was given."""
    c = s.counts
    out: list[str] = []
    g = s.goodput
    if g is None:
        return out
    slo = ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in g.slo.items()) or "none"
    out.append(h("Goodput"))
    out.append(f"SLO: {slo} (TPOT undefined: {g.tpot_undefined})")
    out.append(
        f"throughput {_num(s.requests_per_s)} requests/s   goodput {_num(g.requests_per_s)} requests/s   "
        f"attainment {_pct(g.attainment)} ({g.good} of {c.completed - g.unjudged} completed"
        + (f" and judged; {g.unjudged} left out" if g.unjudged else "")
        + ")"
    )
    out.append("per bound: " + ", ".join(f"{k} {_pct(v)}" for k, v in g.attainment_by_bound.items()))
    if g.unjudged:
        why = {
            "tpot": "their token count is unknown",
            "itl_max": "their source gives the first and last token only",
            "ttft": "their source gives no first token's time",
        }
        out.append(
            "cannot be judged (never good, left out of attainment): "
            + ", ".join(f"{k} {n} ({why.get(k, 'unknown')})" for k, n in g.unjudged_by_bound.items())
        )
    out.append(f"goodput in tokens: {_num(g.output_tokens_per_s)} output tokens/s (the good requests' outputs)")
    out.append("")
    return out


def _fluidity_lines(s: Summary, h, markdown: bool) -> list[str]:
    """The fluidity index and the fluid token rate, where deadlines were given."""
    out: list[str] = []
    f = s.fluidity
    if f is None:
        return out
    d = f.miss_rate
    out.append(h("Fluidity"))
    out.append(
        f"deadlines: first token {f.ttft_deadline * 1000:g} ms, then one every {f.tbt_deadline * 1000:g} ms "
        f"(slack carried forward; docs/metrics/fluidity.md)"
    )
    out.append(
        f"fluidity index: mean {_num(f.index_mean)} over {d.n} requests; fluid (index >= {f.target:g}): "
        f"{_pct(f.attainment)}"
    )
    out.append(
        "deadline miss rate per request: "
        + ", ".join(f"{k} {_num(v)}" for k, v in d.percentiles.items())
        + f", max {_num(d.max)}"
    )
    rate = f.fluid_token_rate
    if rate is None:
        rate = "none (the first-token deadline alone fails)"
    elif rate == float("inf"):
        rate = "unbounded (the slack banked by the first token covers every later one)"
    else:
        rate = f"{rate:.4g} tokens/s"
    out.append(
        f"fluid token generation rate: {rate} (1 / the smallest per-token deadline at which "
        f"{_pct(f.share)} of requests reach index {f.target:g})"
    )
    out.append("")
    return out


def grid(cols: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + ["| " + " | ".join(r) + " |" for r in rows]
    widths = [max(len(x) for x in col) for col in zip(cols, *rows)]
    fmt = lambda r: "  ".join(
        x.ljust(wd) if i in (0, len(r) - 1) else x.rjust(wd) for i, (x, wd) in enumerate(zip(r, widths))
    ).rstrip()
    return [fmt(cols)] + [fmt(r) for r in rows]


def format_summary(s: Summary, fmt: str = "table") -> str:
    if fmt == "json":
        return format_json(s)
    if fmt in ("table", "markdown"):
        return "\n".join(_lines(s, fmt == "markdown")).rstrip() + "\n"
    raise ValueError(f"unknown format {fmt!r} (expected one of {', '.join(FORMATS)})")
