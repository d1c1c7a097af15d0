"""``otel-llm report``: one self-contained HTML file (and PNGs) of a run, from the collector's store
or a traces file.

Figures are Plotly (interactive zoom and hover; plotly.js is embedded once, so the file opens
offline with no network fetch). Each figure is a ``<div class="figure" id="fig-...">``; ``--png DIR``
also writes each as ``DIR/<id>.png`` through kaleido (which drives the system's Chromium). The data
comes from :mod:`collector.analysis.report_data`; this module only draws and writes.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import replace
from datetime import datetime, timezone

import numpy as np

from ..pipeline.ttft_parts import COLORS as PART_COLORS
from .report_data import PART_MEANING, ReportData, WaterfallRow

COLORS = {
    **PART_COLORS,
    "decode": "#67c23a",
    "client": "#303133",
    "engine": "#409eff",
    "preemption": "#f56c6c",
}
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}
#: the stall chart's bars, one colour per cause (the engine's in reds, the way out in purples)
STALL_COLORS = {
    "network/client": "#36cfc9",
    "api_server": "#d3adf7",
    "delivery": "#b37feb",
    "engine:preemption": "#f56c6c",
    "engine:prefill": "#409eff",
    "engine:batch": "#e6a23c",
    "engine:rejected-drafts": "#b88230",
    "engine:idle": "#c0c4cc",
    "engine:other": "#fab6b6",
    "unknown": "#909399",
}


def log_axis(values: np.ndarray) -> dict:
    """A log axis over ``values`` (positive): its range a little past the data (never a decade
    below it) and one label per 1, 2, 5 x 10^k inside it, fewer where that would crowd (Plotly's own
    log ticks pile minor labels on a short range)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    if not len(v):
        return {"type": "log"}
    lo, hi = float(v.min()), float(v.max())
    if hi <= lo:
        lo, hi = lo / 2, hi * 2
    pad = 0.04 * (np.log10(hi) - np.log10(lo))
    rng = [np.log10(lo) - pad, np.log10(hi) + pad]
    ticks = []
    for steps in ((1, 2, 5), (1,)):
        ticks = [
            m * 10.0**k
            for k in range(int(np.floor(rng[0])), int(np.ceil(rng[1])) + 1)
            for m in steps
            if rng[0] <= np.log10(m * 10.0**k) <= rng[1]
        ]
        if len(ticks) <= 8:
            break
    if len(ticks) < 2:  # a narrow range: its ends
        ticks = [lo, hi]
    return {"type": "log", "range": rng, "tickvals": ticks, "ticktext": [f"{t:.3g}" for t in ticks]}


def _layout(title: str, **kw) -> dict:
    base = {
        "title": {"text": title, "x": 0.01},
        "margin": {"l": 70, "r": 20, "t": 50, "b": 50},
        "template": "plotly_white",
        "legend": {"orientation": "h", "y": -0.18},
        "height": 420,
    }
    base.update(kw)
    return base


def _share_figure(d: ReportData, go, make_subplots):
    """Where the client TTFT went over every paired request: one stacked bar, % of the summed TTFT."""
    if not d.ttft_share:
        return None
    fig = go.Figure()
    for part in PART_MEANING:
        v = d.ttft_share.get(part)
        if v is None:
            continue
        fig.add_bar(
            name=f"{part} {v * 100:.1f}%",  # the legend names every part with its share, small ones too
            y=["all paired requests"],
            x=[v * 100],
            orientation="h",
            marker_color=COLORS[part],
            text=[f"{part} {v * 100:.1f}%"] if v >= 0.08 else None,  # inside where it fits, level
            textposition="inside",
            textangle=0,
            hovertemplate=f"{part}: %{{x:.1f}}% of the summed TTFT<extra>{html.escape(PART_MEANING[part])}</extra>",
        )
    fig.update_layout(
        _layout(
            "Where the client TTFT went, over every paired request (% of the summed TTFT)",
            barmode="stack",
            height=220,
            legend={"orientation": "h", "y": -0.5, "traceorder": "normal"},
        )
    )
    fig.update_xaxes(range=[0, 100], ticksuffix="%")
    return fig


def _decomposition_figure(d: ReportData, go, make_subplots):
    """The client TTFT in its parts, for the requests at p50 / p90 / p99 and the slowest (ms)."""
    if not d.decomposition:
        return None
    labels = [label for label, _ in d.decomposition]
    fig = go.Figure()
    for part in PART_MEANING:
        if not any(part in parts for _, parts in d.decomposition):
            continue
        fig.add_bar(
            name=part,
            y=labels,
            x=[parts.get(part, 0.0) * 1e3 for _, parts in d.decomposition],
            orientation="h",
            marker_color=COLORS[part],
            hovertemplate=f"{part}: %{{x:.2f}} ms<extra>{html.escape(PART_MEANING[part])}</extra>",
        )
    fig.update_layout(
        _layout(
            "Client TTFT in its parts: the request at p50 / p90 / p99, then the slowest (ms)",
            barmode="stack",
            height=max(320, 24 * len(labels) + 140),
            legend={"orientation": "h", "y": -0.18, "traceorder": "normal"},  # the bars' order, left to right
        )
    )
    fig.update_yaxes(autorange="reversed", type="category")
    return fig


def _waterfall_segments(fig, ylab: list[str], name: str, color: str, pairs, width: float) -> None:
    """One phase as a bar per row that has both ends (ms after the row's own start)."""
    ys, xs, bases = [], [], []
    for y, (a, b) in zip(ylab, pairs):
        if a is not None and b is not None and b >= a:
            ys.append(y)
            bases.append(a)
            xs.append(b - a)
    if ys:
        fig.add_bar(
            name=name,
            y=ys,
            x=xs,
            base=bases,
            orientation="h",
            width=width,
            marker_color=color,
            hovertemplate=f"{name}: %{{base:.1f}} ms + %{{x:.1f}} ms<extra>%{{y}}</extra>",
        )


def _waterfall_ticks(fig, ylab: list[str], rows: list[WaterfallRow], side: str, key: str, color: str) -> None:
    """One boundary's token events as ticks on each row."""
    xs, ys = [], []
    for y, r in zip(ylab, rows):
        t = getattr(r, key)
        xs += t
        ys += [y] * len(t)
    if xs:
        fig.add_scattergl(
            name=side,
            x=xs,
            y=ys,
            mode="markers",
            marker={
                "symbol": "line-ns",
                "size": 12 if side.startswith("client") else 7,
                "line": {"width": 1, "color": color},
            },
            hovertemplate=f"{side}: %{{x:.1f}} ms<extra>%{{y}}</extra>",
        )


def _waterfall_figure(d: ReportData, go, make_subplots):
    """The waterfall: one row per request (the slowest, then a sample), its phases and token events."""
    if not d.waterfall:
        return None
    rows = [_from_own_start(r) for r in d.waterfall]
    ylab = [f"{r.id} ({r.group})" for r in rows]
    fig = go.Figure()

    def seg(name, color, pairs, width=0.8):
        _waterfall_segments(fig, ylab, name, color, pairs, width)

    seg("client (send -> stream closed)", "rgba(48,49,51,0.18)", [(r.client_submit, r.client_end) for r in rows])
    seg(
        "front end (arrival -> queued)",
        COLORS["front_end"],
        [(r.engine_arrival, r.queue_start) for r in rows],
        0.5,
    )
    if any(r.prefill_leg_start is not None for r in rows):  # disaggregated: the other engine's lane
        seg(
            "prefill engine's leg", COLORS["prefill_leg"], [(r.prefill_leg_start, r.prefill_leg_end) for r in rows], 0.5
        )
    seg("queue", COLORS["queue"], [(r.queue_start, r.first_scheduled) for r in rows], 0.5)
    if any(r.kv_start is not None for r in rows):
        seg("KV transfer", COLORS["kv_transfer"], [(r.kv_start, r.kv_end) for r in rows], 0.3)
    seg("prefill", COLORS["prefill"], [(r.first_scheduled, r.first_generated) for r in rows], 0.5)
    seg("decode", COLORS["decode"], [(r.first_generated, r.engine_end) for r in rows], 0.5)
    for side, key, color in (
        ("client tokens", "client_tokens", "rgba(48,49,51,0.55)"),
        ("engine tokens", "engine_tokens", "rgba(20,60,140,0.55)"),
    ):
        _waterfall_ticks(fig, ylab, rows, side, key, color)
    pre = [(y, r) for y, r in zip(ylab, rows) if r.preemptions]
    if pre:
        fig.add_scatter(
            name="preempted",
            x=[r.engine_end for _, r in pre],
            y=[y for y, _ in pre],
            mode="markers+text",
            marker={"symbol": "x", "color": COLORS["preemption"], "size": 10},
            text=[f"{r.preemptions}x, {r.preemption_time * 1e3:.0f} ms" for _, r in pre],
            textposition="middle right",
        )
    fig.update_layout(
        _layout(
            "Waterfall: the slowest requests, then a sample, one row each (ms after each request's own "
            "start; engine times on the client's clock)",
            barmode="overlay",
            height=max(400, 18 * len(rows) + 160),
            legend={"orientation": "h", "y": -0.18, "traceorder": "normal"},
        )
    )
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(title="ms after the request's start", rangemode="tozero")
    return fig


def _steps_figure(d: ReportData, go, make_subplots):
    """The engine's steps: duration, batch, tokens and KV cache use over the run."""
    st = d.steps
    if st is None:
        return None
    fig = make_subplots(
        rows=4,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.04,
        subplot_titles=("step duration (ms)", "requests in the step", "tokens in the step", "KV cache used"),
    )
    fig.add_scattergl(x=st.start, y=st.duration * 1e3, mode="markers", name="step", marker={"size": 4}, row=1, col=1)
    pre = st.preempted > 0
    if pre.any():
        fig.add_scattergl(
            x=st.start[pre],
            y=st.duration[pre] * 1e3,
            mode="markers",
            name="a preemption in the step",
            marker={"symbol": "x", "size": 9, "color": COLORS["preemption"]},
            row=1,
            col=1,
        )
    fig.add_scattergl(x=st.start, y=st.batch_size, mode="lines", name="batch size", line_shape="hv", row=2, col=1)
    # each value holds from its step to the next (steps, not ramps across the idle gaps)
    for name, y in (("prefill tokens", st.prefill_tokens), ("decode tokens", st.decode_tokens)):
        fig.add_scattergl(x=st.start, y=np.maximum(y, 0), mode="lines", name=name, line_shape="hv", row=3, col=1)
    kv = np.isfinite(st.kv_usage)
    if kv.any():
        fig.add_scattergl(
            x=st.start[kv], y=st.kv_usage[kv], mode="lines", name="KV usage", line_shape="hv", row=4, col=1
        )
    shown = "" if st.kept == st.total else f" ({st.kept:,} of {st.total:,} shown, the slowest of each stretch kept)"
    fig.update_layout(_layout(f"The engine's steps (seconds after the first request){shown}", height=720))
    fig.update_xaxes(title="s", row=4, col=1)
    return fig


def _itl_figure(d: ReportData, go, make_subplots):
    """The inter-token latency's CDF at each boundary (ms)."""
    if not d.itl_cdf:
        return None
    fig = go.Figure()
    for side, (x, y) in d.itl_cdf.items():
        fig.add_scatter(x=x * 1e3, y=y, mode="lines", name=side, line={"color": COLORS[side], "shape": "hv"})
    fig.update_layout(_layout("Inter-token latency, CDF at each boundary (ms)"))
    fig.update_xaxes(title="ms", **log_axis(np.concatenate([x for x, _ in d.itl_cdf.values()]) * 1e3))
    fig.update_yaxes(title="fraction of gaps", range=[0, 1.01])
    return fig


def _over_time_figure(d: ReportData, go, make_subplots):
    """TTFT and E2E over the run, by send time."""
    if not any(len(x) for x, _ in d.over_time.values()):
        return None
    fig = go.Figure()
    for metric, (x, y) in d.over_time.items():
        fig.add_scattergl(x=x, y=y, mode="markers", name=metric.upper(), marker={"size": 5})
    fig.update_layout(_layout("TTFT and E2E over the run (by send time, seconds)"))
    fig.update_xaxes(title="sent at (s)")
    fig.update_yaxes(title="s", **log_axis(np.concatenate([y for _, y in d.over_time.values()])))
    return fig


def _stalls_figure(d: ReportData, go, make_subplots):
    """Stall seconds by cause (each request's longest client gap over the threshold)."""
    if not d.paired:
        return None
    fig = go.Figure()
    causes = list(d.stall_seconds)
    fig.add_bar(
        x=causes,
        y=[d.stall_seconds[c] for c in causes],
        text=[f"{d.stall_requests[c]} requests" for c in causes],
        textposition="outside",
        marker_color=[STALL_COLORS.get(c, "#909399") for c in causes],
    )
    fig.update_layout(_layout("Stall seconds by cause (each request's longest client gap over the threshold)"))
    fig.update_yaxes(title="s", rangemode="tozero")
    if not any(d.stall_seconds.values()):
        fig.add_annotation(
            text=f"no client gap over the stall threshold in {d.paired} paired requests",
            x=0.5,
            y=0.5,
            xref="paper",
            yref="paper",
            showarrow=False,
            font={"size": 16},
        )
    return fig


def _acceptance_figure(d: ReportData, go, make_subplots):
    """Speculative decoding: each request's acceptance rate against its client's largest gap,
    coloured by the gap's stall cause; the hover says what the step that ended the gap verified
    and accepted for the request."""
    if not d.acceptance:
        return None
    fig = go.Figure()
    for cause in dict.fromkeys(r.stall for r in d.acceptance):
        rows = [r for r in d.acceptance if r.stall == cause]
        fig.add_scatter(
            x=[r.acceptance_rate for r in rows],
            y=[None if r.client_itl_max is None else r.client_itl_max * 1e3 for r in rows],
            mode="markers",
            name=cause,
            marker={"color": STALL_COLORS.get(cause, "#606266"), "size": 7},
            text=[_gap_step_text(r) for r in rows],
            hovertemplate="%{text}<extra>%{fullData.name}</extra>",
        )
    fig.update_layout(_layout("Acceptance per request against its largest gap (colour: the gap's stall cause)"))
    fig.update_xaxes(title="acceptance rate (accepted / draft tokens)", range=[-0.02, 1.02])
    fig.update_yaxes(title="client's largest gap (ms)", rangemode="tozero")
    return fig


def _gap_step_text(r) -> str:
    """A request's hover in the acceptance figure."""
    step = (
        "its step's drafts unknown"
        if r.gap_step_draft_tokens is None
        else f"the step that ended it: {r.gap_step_draft_tokens} drafts, {r.gap_step_accepted_tokens} accepted"
    )
    length = "-" if r.mean_acceptance_length is None else f"{r.mean_acceptance_length:.2f}"
    return (
        f"{html.escape(r.id)}<br>acceptance {r.acceptance_rate:.3f}, {length} tokens per verify step"
        f"<br>largest gap {_fmt(r.client_itl_max)}; {step}"
    )


def _sweep_figure(d: ReportData, go, make_subplots):
    """Against load: attainment, latency percentiles and the TTFT's parts, one point per run."""
    if not d.sweep:
        return None
    fig = make_subplots(
        rows=1,
        cols=3,
        subplot_titles=("SLO attainment", "latency percentiles (s)", "mean client TTFT in its parts (s)"),
    )
    x = [p.arrival_rate for p in d.sweep]
    if any(p.attainment is not None for p in d.sweep):
        fig.add_scatter(x=x, y=[p.attainment for p in d.sweep], mode="lines+markers", name="attainment", row=1, col=1)
    for key in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99"):
        fig.add_scatter(
            x=x,
            y=[getattr(p, key) for p in d.sweep],
            mode="lines+markers",
            name=key.replace("_", " "),
            row=1,
            col=2,
        )
    for k in [k for k in PART_MEANING if any(k in p.parts_mean for p in d.sweep)]:
        fig.add_bar(
            x=x,
            y=[p.parts_mean.get(k) for p in d.sweep],
            name=k,
            marker_color=COLORS[k],
            row=1,
            col=3,
        )
    fig.update_layout(_layout("Against load: one point per run (x: the run's client sends per second)"))
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="requests/s sent")
    return fig


#: the report's figures in page order, by id: each draws its figure, or None where the data has none
FIGURES = {
    "fig-share": _share_figure,
    "fig-decomposition": _decomposition_figure,
    "fig-waterfall": _waterfall_figure,
    "fig-steps": _steps_figure,
    "fig-itl": _itl_figure,
    "fig-over-time": _over_time_figure,
    "fig-stalls": _stalls_figure,
    "fig-acceptance": _acceptance_figure,
    "fig-sweep": _sweep_figure,
}


def figures(d: ReportData) -> dict[str, object]:
    """The report's figures, by id (Plotly ``go.Figure`` objects); only those with data."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    drawn = {fid: draw(d, go, make_subplots) for fid, draw in FIGURES.items()}
    return {fid: fig for fid, fig in drawn.items() if fig is not None}


def _from_own_start(r: WaterfallRow) -> WaterfallRow:
    """A waterfall row in ms after the request's own start (the client's send, else the engine's
    arrival, else the server's receipt), so that every request's phases show at one scale."""
    t0 = next((t for t in (r.client_submit, r.engine_arrival, r.server_received) if t is not None), 0.0)
    ms = lambda t: None if t is None else (t - t0) * 1e3
    times = ("client_submit", "client_end", "engine_arrival", "queue_start", "first_scheduled", "first_generated")
    times += ("prefill_leg_start", "prefill_leg_end", "kv_start", "kv_end")
    return replace(
        r,
        **{k: ms(getattr(r, k)) for k in (*times, "engine_end", "server_received", "server_end")},
        client_tokens=[ms(t) for t in r.client_tokens],
        engine_tokens=[ms(t) for t in r.engine_tokens],
        server_tokens=[ms(t) for t in r.server_tokens],
    )


def _fmt(v, unit: str = "s") -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1e3:.2f} ms" if abs(v) < 1 else f"{v:.3f} s"
    if unit == "%":
        return f"{v * 100:.1f}%"
    return f"{v:,.2f}"


def _summary_html(d: ReportData) -> str:
    parts = []
    for boundary, s in d.summaries.items():
        c = s.counts
        g = s.goodput
        head = (
            f"<h3>{boundary} boundary</h3><p>{c.requests} requests ({c.completed} ok, {c.failed} failed, "
            f"{c.cancelled} cancelled, {c.rejected} rejected) over {s.window.seconds:.2f} s: "
            f"{_fmt(s.requests_per_s, 'n')} requests/s, {_fmt(s.output_tokens_per_s, 'n')} output tokens/s"
        )
        if g is not None:
            head += (
                f"; goodput {_fmt(g.requests_per_s, 'n')} requests/s at {html.escape(_slo_text(g.slo))}, "
                f"attainment {_fmt(g.attainment, '%')} ("
                + ", ".join(f"{k} {_fmt(v, '%')}" for k, v in g.attainment_by_bound.items())
                + ")"
            )
            if g.unjudged:
                head += (
                    f"; {g.unjudged} completed requests cannot be judged on a bound their source does not tell ("
                    + ", ".join(f"{k} {n}" for k, n in g.unjudged_by_bound.items())
                    + "): never good, left out of attainment"
                )
        if c.tokens_unknown:
            head += f"; {c.tokens_unknown} requests' token counts unknown (not counted)"
        head += ".</p>"
        keys = list(next(iter(s.latency.values())).percentiles)
        rows = "".join(
            f"<tr><td>{name}</td><td>{dist.n}</td>"
            + "".join(f"<td>{_fmt(dist.percentiles[k])}</td>" for k in keys)
            + f"<td>{_fmt(dist.mean)}</td><td>{_fmt(dist.max)}</td></tr>"
            for name, dist in s.latency.items()
        )
        table = (
            "<table><tr><th>metric</th><th>n</th>"
            + "".join(f"<th>{k}</th>" for k in keys)
            + f"<th>mean</th><th>max</th></tr>{rows}</table>"
            f"<p class='note'>percentiles: {s.percentile_method}; ITL pooled over every gap.</p>"
        )
        parts.append(head + table)
    return "".join(parts)


def _traces_html(d: ReportData) -> str:
    """Each trace of several calls (an agent's, a chain's), its calls in order: the TTFT's parts
    of each call and the idle time between calls that the model did not spend."""
    if not d.traces:
        return ""
    parts = [k for k in PART_MEANING if any(k in r.parts for t in d.traces for r in t.calls)]
    out = [
        "<h2>Traces of several calls</h2><p class='note'>An agent's or a chain's calls under one "
        "application span, in order; idle: from the end of the call before to this one's submit, "
        "time the model did not spend. Milliseconds.</p>"
    ]
    for t in d.traces:
        share = t.in_calls_s / t.span_s * 100 if t.span_s > 0 else 100.0
        head = "".join(f"<th>{h}</th>" for h in ("call", "id", "at (s)", "idle", "client_ttft", *parts, "e2e"))
        ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"
        rows = "".join(
            f"<tr><td>{r.call}</td><td>{html.escape(r.id)}</td><td>{(r.submit_ns - t.calls[0].submit_ns) / 1e9:.3f}"
            f"</td><td>{ms(r.idle_before)}</td><td>{ms(r.client_ttft)}</td>"
            + "".join(f"<td>{ms(getattr(r, k))}</td>" for k in parts)
            + f"<td>{ms(r.client_e2e)}</td></tr>"
            for r in t.calls
        )
        out.append(
            f"<h3 data-trace='{t.trace_id}'>trace {t.trace_id}</h3><p class='note'>{len(t.calls)} calls over "
            f"{t.span_s:.3f} s, {share:.0f}% of it in calls; under span {html.escape(t.caller_span_id or '-')}"
            f"</p><table><tr>{head}</tr>{rows}</table>"
        )
    return "".join(out)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1400px; color: #303133; }
h1 { margin-bottom: 4px; } .note { color: #606266; font-size: 90%; }
table { border-collapse: collapse; margin: 8px 0; }
td, th { padding: 3px 10px; border-bottom: 1px solid #ebeef5; text-align: right; }
td:first-child, th:first-child { text-align: left; } .figure { margin: 28px 0; min-height: 300px; }
dl.parts dt { font-weight: 600; } dl.parts dd { margin: 0 0 6px 16px; color: #606266; }
"""


#: said where the engine-step panels would be, when the data has no llm.engine.step span
NO_STEPS = (
    "No engine steps in this data, so no step panels: engines send llm.engine.step spans at "
    "OTEL_LLM_DETAIL=steps only (the default, phases, sends request and phase spans)."
)


def render_html(d: ReportData, figs: dict[str, object]) -> str:
    """The whole report as one HTML document (plotly.js inline, once)."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    origin = datetime.fromtimestamp(d.origin_ns / 1e9, timezone.utc).isoformat(timespec="seconds")
    runs = ", ".join(f"{html.escape(r)} ({n})" for r, n in d.runs) or "-"
    offset = (
        f"engine clock minus client clock {d.clock_offset_s * 1e3:.3f} ms "
        + (f"(bounds {d.clock_offset_width_s * 1e3:.3f} ms wide), " if d.clock_offset_width_s is not None else "")
        + f"{d.paired} requests paired"
        if d.clock_offset_s is not None
        else "no request seen at both boundaries"
    )
    body = [
        f"<h1>{html.escape(d.title)}</h1>",
        f"<p class='note'>{html.escape(d.source)} &middot; first request {origin} &middot; runs: {runs} &middot; "
        f"services: {html.escape(', '.join(d.services) or '-')} &middot; {offset}</p>",
        "<h2>Summary</h2>",
        _summary_html(d),
        _traces_html(d),
        "<h2>Where the time went</h2><dl class='parts'>"
        + "".join(
            f"<dt>{k}</dt><dd>{html.escape(v)}</dd>"
            for k, v in PART_MEANING.items()
            if not d.decomposition or any(k in parts for _, parts in d.decomposition)
        )
        + "</dl>",
    ]
    if "fig-steps" not in figs:
        body.append(f"<p class='note' data-note='no-steps'>{html.escape(NO_STEPS)}</p>")
    for fid, fig in figs.items():
        div = pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=fid, config=PLOTLY_CONFIG)
        body.append(f"<div class='figure' data-figure='{fid}'>{div}</div>")
    meta = json.dumps({"figures": list(figs), "generated_by": "otel-llm report"})
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(d.title)}</title><style>{_CSS}</style>"
        f"<script type='text/javascript'>{get_plotlyjs()}</script>"
        f"<script type='application/json' id='report-meta'>{meta}</script>"
        f"</head><body>{''.join(body)}</body></html>"
    )


def write_pngs(figs: dict[str, object], directory: str) -> list[str]:
    """Each figure as ``directory/<id>.png`` (kaleido, through the system's Chromium: one browser
    for all of them, not one a figure)."""
    import plotly.io as pio

    os.makedirs(directory, exist_ok=True)
    out = [os.path.join(directory, f"{fid}.png") for fid in figs]
    heights = [fig.layout.height or 420 for fig in figs.values()]
    pio.write_images(list(figs.values()), out, width=1400, height=heights, scale=1)
    return out


def _slo_text(slo) -> str:
    if isinstance(slo, dict):
        return ", ".join(f"{k} <= {v:g} s" for k, v in slo.items() if v is not None)
    return str(slo)
