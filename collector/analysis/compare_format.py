"""Formatting ``otel-llm compare`` for people (milliseconds)."""

from __future__ import annotations

from otel_llm.metrics.summary_format import grid

from ..pipeline.stalls import NONE, STALL_CLASSES, UNKNOWN
from .compare import TTFT_PARTS, ComparisonSummary, RequestComparison, traces_of_several_calls


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def format_comparison(
    rows: list[RequestComparison], summary: ComparisonSummary, top: int = 20, markdown: bool = False
) -> str:
    h = (lambda t: f"### {t}") if markdown else (lambda t: f"== {t} ==")
    out = [h("Clock offset (engine - client)"), *_offset_lines(summary.offset)]
    out += ["", h(f"Client TTFT decomposition (ms; {summary.percentile_method})")]
    d = summary.distributions
    keys = list(next(iter(d.values())).percentiles)
    cols = ["part", "n", "mean", *keys, "max"]
    lines = []
    for k in (
        "client_ttft",
        *TTFT_PARTS,
        "engine_ttft",
        "client_itl",
        "engine_itl",
        "client_itl_per_token",
        "engine_itl_per_token",
        "client_itl_max",
        "engine_itl_max",
        "client_e2e",
    ):
        if k not in d:  # a part no request has (the server boundary's, without a server span)
            continue
        x = d[k]
        lines.append([k, str(x.n), _ms(x.mean), *(_ms(x.percentiles[p]) for p in keys), _ms(x.max)])
    out += grid(cols, lines, markdown)
    if "acceptance_rate" in d:  # speculative decoding
        x = d["acceptance_rate"]
        rate = lambda v: "-" if v is None or v != v else f"{v:.3f}"
        out += ["", h(f"Speculative decoding, per request ({summary.percentile_method})")]
        out += grid(
            ["", "n", "mean", *keys, "max"],
            [["acceptance_rate", str(x.n), rate(x.mean), *(rate(x.percentiles[p]) for p in keys), rate(x.max)]],
            markdown,
        )
        out += _largest_stall(rows)
    if summary.ttft_share is not None:
        out.append(
            "share of client TTFT: "
            + ", ".join(
                f"{k} {v * 100:.1f}%" if v is not None else f"{k} unknown (in the queue)"
                for k, v in summary.ttft_share.items()
            )
            + f"  (parts sum to the TTFT within {summary.max_abs_parts_sum_error_s * 1e6:.1f} us)"
        )
    st = summary.stalls
    out += [
        "",
        f"paired requests: {summary.requests_paired}"
        + (
            f" ({summary.paired_by_id} by the client's response id: no trace context at the server)"
            if summary.paired_by_id
            else ""
        )
        + f", unpaired records: {summary.records_unpaired}; "
        "stalls: " + ", ".join(f"{k} {v}" for k, v in st.items() if v or k in STALL_CLASSES),
        "timeline violations: "
        + (
            f"{summary.records_with_violations} records ("
            + ", ".join(f"{k} {n}" for k, n in summary.violations.items())
            + "): their broken parts are unknown, not 0"
            if summary.records_with_violations
            else "none"
        ),
        "",
        h(f"Slowest {min(top, len(rows))} by client TTFT (ms)"),
    ]
    worst = sorted(rows, key=lambda r: -(r.client_ttft or 0))[:top]
    out += _slowest(worst, rows, markdown)
    out += _traces_of_several_calls(rows, top, markdown, h)
    return "\n".join(out) + "\n"


def _largest_stall(rows: list[RequestComparison]) -> list[str]:
    """Speculative decoding: the largest stall, its cause and what the step that ended it
    verified and accepted for the request (read with the request's own acceptance)."""
    stalled = [r for r in rows if r.stall not in (NONE, UNKNOWN) and r.stall_gap is not None]
    if not stalled:
        return ["largest stall: none over the threshold"]
    r = max(stalled, key=lambda r: r.stall_gap)
    d, a = r.gap_step_draft_tokens, r.gap_step_accepted_tokens
    step = "its step's drafts unknown" if d is None else f"the step that ended it verified {d} drafts, accepted {a}"
    own = "" if r.acceptance_rate is None else f" (the request's acceptance {r.acceptance_rate:.3f})"
    return [f"largest stall: {r.id} {_ms(r.stall_gap)} ms ({r.stall}); {step}{own}"]


def _offset_lines(o) -> list[str]:
    """The clock offset applied, its bounds and the pairs left out of them."""
    if o.high is None:
        out = [f"applied {o.theta * 1000:.3f} ms ({o.source})"]
    elif o.low is None:
        out = [f"applied {o.theta * 1000:.3f} ms ({o.source}); at most {o.high * 1000:.3f} ms"]
    else:
        out = [
            f"applied {o.theta * 1000:.3f} ms ({o.source}); bounds [{o.low * 1000:.3f}, "
            f"{o.high * 1000:.3f}] ms, width {o.width * 1000:.3f} ms, from {o.pairs_used} pairs"
            + ("" if o.consistent else "  (inconsistent: the bounds cross; timing jitter or clock drift)")
        ]
    return out + [f"  {n} pairs left out of the bounds: {why}" for why, n in o.excluded.items()]


def _slowest(worst: list[RequestComparison], rows: list[RequestComparison], markdown: bool) -> list[str]:
    shown = [k for k in TTFT_PARTS if any(k in r.parts for r in rows)]
    return grid(
        ["id", "client_ttft", *shown, "engine_ttft", "itl_max c/e", "preempt", "stall"],
        [
            [
                r.id,
                _ms(r.client_ttft),
                *(_ms(getattr(r, k)) for k in shown),
                _ms(r.engine_ttft),
                f"{_ms(r.client_itl_max)}/{_ms(r.engine_itl_max)}",
                "-" if r.preemptions is None else str(r.preemptions),
                r.stall,
            ]
            for r in worst
        ],
        markdown,
    )


def _traces_of_several_calls(rows: list[RequestComparison], top: int, markdown: bool, h) -> list[str]:
    """Each trace that holds several paired calls (an agent's or a chain's, under one application
    span), its calls in order with their TTFT parts and the time between them: the longest ``top``."""
    several = traces_of_several_calls(rows, top)
    if not several:
        return []
    out = ["", h(f"Traces of several calls ({len(several)} shown; ms; idle: between calls, not the model's time)")]
    shown = [k for k in TTFT_PARTS if any(k in r.parts for t in several for r in t.calls)]
    for t in several:
        t0 = t.calls[0].submit_ns
        out += [
            "",
            f"trace {t.trace_id}: {len(t.calls)} calls over {t.span_s:.3f} s, in calls {t.in_calls_s:.3f} s "
            f"({t.in_calls_s / t.span_s * 100 if t.span_s > 0 else 100:.0f}%"
            + (
                "; the calls overlap: their times add up past the span, idle is negative"
                if t.in_calls_s > t.span_s
                else ""
            )
            + f"), under span {t.caller_span_id or '-'}",
        ]
        out += grid(
            ["call", "id", "at (s)", "idle", "client_ttft", *shown, "e2e"],
            [
                [
                    str(r.call),
                    r.id,
                    f"{(r.submit_ns - t0) / 1e9:.3f}",
                    _ms(r.idle_before),
                    _ms(r.client_ttft),
                    *(_ms(getattr(r, k)) for k in shown),
                    _ms(r.client_e2e),
                ]
                for r in t.calls
            ],
            markdown,
        )
    return out
