"""``otel-llm collector``: run the collector until SIGINT / SIGTERM (which flush to the store)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

from otel_llm import environment
from otel_llm.cli_options import add_selection_options, number, percentile_list, selection_of
from otel_llm.declared_options import add_option
from otel_llm.metrics.percentiles import METHODS
from otel_llm.semconv import Boundary

from .config import AssemblyConfig, CollectorConfig, options_of, parse_slos


def register(sub) -> None:
    p = sub.add_parser(
        "collector",
        help="receive OTLP traces, derive per-request metrics, export to Prometheus/OTLP",
        description="Receive spans from engines (engine_hooks) and clients over OTLP, assemble each "
        "request's trace, derive TTFT/ITL/TPOT/E2E at both boundaries and the client TTFT "
        "decomposition, store one record per request and boundary, and export metrics.",
        epilog="Every option can also be set as OTEL_LLM_COLLECTOR_<OPTION> (e.g. OTEL_LLM_COLLECTOR_STORE, "
        "OTEL_LLM_COLLECTOR_MAX_TRACES); the command line wins. Addresses, URLs and paths take 'off' to "
        "disable. Receivers bind to loopback by default. SIGINT / SIGTERM flush what was accepted to the store.",
    )
    for f in options_of(CollectorConfig) + options_of(AssemblyConfig):
        add_option(p, f, environment.collector_variable(f.metadata["flag"]))
    slo_var, tpot_var = environment.collector_variable("slo"), environment.collector_variable("tpot-undefined")
    env_slo = environment.env_str(slo_var)
    p.add_argument(
        "--slo",
        action="append",
        default=None,
        metavar="[NAME:]BOUNDS",
        help="an SLO whose good requests are counted (llm_slo_good_requests_total{slo=NAME}); "
        f"bounds in seconds, e.g. ttft=1,tpot=0.05,itl_max=0.5,e2e=10; repeatable (${slo_var}: SLOs "
        "separated by ';')",
    )
    p.set_defaults(env_slo=[v for v in (env_slo or "").split(";") if v.strip()])
    p.add_argument(
        "--tpot-undefined",
        choices=("pass", "fail"),
        default=environment.parsed(tpot_var, "pass", _pass_or_fail),
        help=f"whether requests with <= 1 output token pass a tpot bound (default pass; ${tpot_var})",
    )
    p.set_defaults(func=run)


def _pass_or_fail(v: str) -> str:
    if v not in ("pass", "fail"):
        raise ValueError("expected pass or fail")
    return v


def config_from_args(args: argparse.Namespace) -> CollectorConfig:
    """The configuration the parsed options describe (CLIError when it is not a usable one)."""
    from otel_llm.cli_options import CLIError

    try:
        slos = parse_slos(args.slo or args.env_slo, args.tpot_undefined)
        assembly = AssemblyConfig(**{f.name: getattr(args, f.name) for f in options_of(AssemblyConfig)})
        return CollectorConfig(
            **{f.name: getattr(args, f.name) for f in options_of(CollectorConfig)}, assembly=assembly, slos=slos
        )
    except ValueError as exc:
        raise CLIError(f"collector: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from otel_llm.cli_options import CLIError

    from .service import Collector

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = config_from_args(args)
    try:
        collector = Collector(cfg).start()
    except (OSError, ValueError) as exc:
        raise CLIError(f"collector: {exc}") from None
    done = threading.Event()

    def on_signal(signum, frame):
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    parts = [f"{type(r).__name__.replace('Receiver', '')} {r.address[0]}:{r.address[1]}" for r in collector.receivers]
    if collector.prometheus:
        parts.append(f"Prometheus http://{collector.prometheus.address[0]}:{collector.prometheus.address[1]}/metrics")
    print(
        "otel-llm collector: "
        + ", ".join(parts)
        + (f"; store {cfg.store}" if cfg.store else "")
        + (f"; SLOs {', '.join(f'{k}={v.describe()}' for k, v in cfg.slos.items())}" if cfg.slos else ""),
        flush=True,
    )
    done.wait()
    print("otel-llm collector: stopping, flushing traces in flight to the store...", file=sys.stderr, flush=True)
    collector.stop()
    c = collector.self_counters()
    print(
        f"otel-llm collector: stopped; {c['records_derived']} records derived, {c.get('store_records', 0)} stored",
        file=sys.stderr,
        flush=True,
    )
    return 0


def add_stall_options(p: argparse.ArgumentParser) -> None:
    """``--stall`` and ``--stall-factor`` (compare, report): when a client gap is a stall."""
    from .pipeline.stalls import DEFAULT_FACTOR, DEFAULT_FLOOR_S

    p.add_argument(
        "--stall",
        type=number(float, 0, strict=True),
        default=DEFAULT_FLOOR_S,
        metavar="S",
        help="a paired request's largest client gap between tokens is a stall when over both S and "
        f"--stall-factor times the median of the request's other gaps (default {DEFAULT_FLOOR_S} s)",
    )
    p.add_argument(
        "--stall-factor",
        type=number(float, 0),
        default=DEFAULT_FACTOR,
        metavar="K",
        help=f"see --stall (default {DEFAULT_FACTOR:g}; 0: S alone decides)",
    )


def register_compare(sub) -> None:
    from .analysis.client_results import add_client_results_options
    from .pipeline.ttft_parts import COARSE, sum_text

    p = sub.add_parser(
        "compare",
        help="client vs engine per request: where the client's TTFT went",
        description="From the collector's store: per request and as distributions, the client TTFT in its "
        f"parts ({sum_text()} with the HTTP server span; {' and '.join(COARSE)} where it is missing); client "
        "vs engine ITL; the cause of "
        "each stall (the layer where it first shows: engine (preemption, a batch-mate's prefill, a growing "
        "batch, idle), API server, network/client). Bounds the clock offset between client and "
        "engine hosts per pair and corrects the two-clock parts by it.",
    )
    p.add_argument(
        "--store",
        required=True,
        metavar="PATH",
        action="append",
        help="the collector's store; repeat it (or a quoted glob) for the stores of several collectors",
    )
    p.add_argument(
        "--clock-offset",
        default="auto",
        metavar="auto|SECONDS",
        help="engine clock minus client clock: 'auto' estimates it from span nesting (0 when the bounds "
        "allow one clock); a number applies it (default auto)",
    )
    add_stall_options(p)
    p.add_argument(
        "--percentiles",
        type=percentile_list,
        default=["50", "90", "99"],
        metavar="P,P,...",
        help="percentiles of the distributions (default 50,90,99)",
    )
    p.add_argument("--percentile-method", choices=METHODS, default="nearest-rank")
    p.add_argument(
        "--top",
        type=number(int, 0),
        default=20,
        help="table/markdown: requests listed, slowest client TTFT first (default 20)",
    )
    p.add_argument("--format", choices=("table", "json", "markdown"), default="table")
    add_client_results_options(p)
    add_selection_options(p)
    p.set_defaults(func=run_compare)


def _why_unpaired(records) -> str:
    """The likely cause, in words, of records none of which pair (for compare's refusal)."""
    by = {b: sum(1 for r in records if r.boundary == b) for b in Boundary.ALL}
    counts = ", ".join(f"{n} {b}" for b, n in by.items())
    if not records:
        return "the store holds no records (is the collector the endpoint the client and the engine export to?)"
    if by[Boundary.CLIENT] and not by[Boundary.ENGINE]:
        return (
            f"records: {counts}. The engine sent nothing: start it with OTEL_LLM_ENABLE=1 (vLLM's plugin) or "
            "instrument() it, and point OTEL_EXPORTER_OTLP_ENDPOINT at this collector"
        )
    if by[Boundary.ENGINE] and not by[Boundary.CLIENT]:
        return (
            f"records: {counts}. No client spans: run otel-llm bench or an instrumented client with "
            "OTEL_EXPORTER_OTLP_ENDPOINT at this collector, or give a load tool's results (--client-results)"
        )
    return (
        f"records: {counts}; none of the client's requests reached a traced engine in the same trace "
        "(the client sends traceparent; the engine's server must take it: OTEL_LLM_ENABLE=1)"
    )


def run_compare(args: argparse.Namespace) -> int:
    import json

    from otel_llm.cli_options import CLIError

    from .analysis.client_results import apply_client_results
    from .analysis.compare import compare, summarize_comparison, to_json
    from .analysis.compare_format import format_comparison
    from .storage.store import read_stores

    try:
        offset = None if args.clock_offset == "auto" else float(args.clock_offset)
    except ValueError:
        raise CLIError("--clock-offset: 'auto' or a number of seconds") from None
    try:
        batch, steps = read_stores(args.store)
    except (OSError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    records = apply_client_results(args, batch.selected(selection_of(args))).records()
    cmp = compare(records, offset, args.stall, steps, args.stall_factor)
    if not cmp.rows:
        raise CLIError(f"{', '.join(args.store)}: no request seen at both boundaries; {_why_unpaired(records)}")
    summary = summarize_comparison(cmp, args.percentiles, args.percentile_method)
    if args.format == "json":
        print(json.dumps(to_json(cmp, summary), indent=2))
    else:
        sys.stdout.write(format_comparison(cmp.rows, summary, args.top, markdown=args.format == "markdown"))
    return 0


# -- otel-llm report -------------------------------------------------------------------------------


def register_report(sub) -> None:
    from otel_llm.cli_options import number

    from .analysis.client_results import add_client_results_options

    p = sub.add_parser(
        "report",
        help="an HTML report of a run: summary, TTFT decomposition, waterfall, engine steps, ITL, stalls",
        description="Write one self-contained HTML file (opens offline; interactive zoom) from the collector's "
        "store or a traces file: the summary at both boundaries, the client TTFT decomposition, a waterfall of "
        "the slowest requests and a sample with their token events, the engine's steps on the same axis, ITL "
        "CDFs, TTFT/E2E over time, stall seconds by cause, and (several runs) attainment and latency against load.",
    )
    _add_source_options(p)
    p.add_argument("-o", "--output", default="report.html", metavar="FILE", help="the HTML file (default report.html)")
    p.add_argument("--png", metavar="DIR", help="also write each figure as DIR/<figure>.png (needs Chromium)")
    p.add_argument("--slo", metavar="BOUNDS", help="goodput SLO, e.g. ttft=1,tpot=0.05")
    p.add_argument("--slowest", type=number(int, 0), default=20, metavar="N", help="slowest requests shown (20)")
    p.add_argument("--sample", type=number(int, 0), default=100, metavar="N", help="other requests shown (100)")
    add_stall_options(p)
    add_client_results_options(p)
    p.add_argument("--title", default="otel-llm report")
    p.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    from otel_llm.cli_options import CLIError, check_output_path, slo_option

    from .analysis.client_results import apply_client_results
    from .analysis.report import figures, render_html, write_pngs
    from .analysis.report_data import build_report

    check_output_path(args.output)
    slo = slo_option(args.slo)
    t0 = time.perf_counter()
    batch, steps, source = _load_selected(args, "report")
    batch = apply_client_results(args, batch)
    d = build_report(
        batch,
        steps,
        source=source,
        slo=slo,
        slowest=args.slowest,
        sample=args.sample,
        stall_threshold=args.stall,
        stall_factor=args.stall_factor,
        title=args.title,
    )
    figs = figures(d)
    doc = render_html(d, figs)
    with open(args.output, "w", encoding="utf-8") as fh:
        fh.write(doc)
    took = time.perf_counter() - t0
    print(
        f"otel-llm report: {args.output} ({os.path.getsize(args.output) / 2**20:.1f} MiB, {len(figs)} figures, "
        f"{len(batch)} records, written in {took:.1f} s)",
        file=sys.stderr,
    )
    if args.png:
        try:
            paths = write_pngs(figs, args.png)
        except Exception as exc:  # kaleido without a browser, most often
            raise CLIError(f"--png: {type(exc).__name__}: {exc}") from None
        print(f"otel-llm report: {len(paths)} PNGs in {args.png}", file=sys.stderr)
    return 0


def _add_source_options(p) -> None:
    """--store / --traces and the selection options, as report and export take them."""
    from otel_llm.cli_options import add_selection_options

    p.add_argument("--store", metavar="PATH", action="append", help="the collector's store (repeat, or a glob)")
    p.add_argument("--traces", metavar="FILE", help="a traces file (OTLP JSON lines, as OTEL_LLM_TRACES_FILE writes)")
    add_selection_options(p)


def _load_selected(args, command: str):
    """(records the selection keeps, engine steps, source text); usage errors as CLIError."""
    from otel_llm.cli_options import CLIError, selection_of

    if (args.store is None) == (args.traces is None):
        raise CLIError(f"{command}: give one of --store PATH or --traces FILE")
    try:
        batch, steps, source = _load(args)
    except (OSError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    if not len(batch):
        raise CLIError(f"{source}: no records yet (is the collector receiving spans? see docs/viewing.md)")
    whole = len(batch)
    sel = selection_of(args)
    batch = batch.selected(sel)
    if not len(batch):
        if sel == type(sel)():  # no selection given: all that was left out is warm-up requests
            raise CLIError(f"{source}: its {whole} records are all bench warm-ups (--include-warmup reads them)")
        raise CLIError(f"{source}: none of its {whole} records match the selection")
    return batch, steps, source


def _load(args):
    if args.store is not None:
        from .storage.store import read_stores

        batch, steps = read_stores(args.store)
        return batch, steps, ", ".join(args.store)
    from .analysis.offline import read_trace_file

    batch, steps = read_trace_file(args.traces)
    return batch, steps, args.traces


# -- otel-llm export ------------------------------------------------------------------------------


def register_export(sub) -> None:

    p = sub.add_parser(
        "export",
        help="a run in another format: perfetto (Chrome trace event JSON for ui.perfetto.dev), parquet",
        description="Export records and engine steps from the collector's store or a traces file. "
        "--format perfetto: one track per request (client span, engine phases, token events as instants, "
        "preemptions) and one per engine process (its steps, with batch size and KV usage counters); open the "
        "file in ui.perfetto.dev or chrome://tracing. --format parquet: the records, one row per request and "
        "boundary with every column of the store (token events as int64 lists), for DuckDB, pandas or Spark; "
        "the engine steps go to FILE with .steps.parquet (needs pyarrow: the parquet extra).",
    )
    _add_source_options(p)
    p.add_argument(
        "--format", choices=("perfetto", "parquet"), default="perfetto", help="output format (default perfetto)"
    )
    p.add_argument("-o", "--output", default="-", metavar="FILE", help="output file (default: standard output)")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from otel_llm.cli_options import CLIError, check_output_path

    from .analysis.perfetto import trace_events

    check_output_path(args.output)
    batch, steps, _source = _load_selected(args, "export")
    if args.format == "parquet":
        if args.output == "-":
            raise CLIError("export --format parquet: give -o FILE.parquet")
        from .analysis.parquet import write_parquet  # pyarrow: the CLI names the extra when it is missing

        rows, steps_path, n_steps = write_parquet(batch, steps, args.output)
        print(f"otel-llm export: {args.output} ({rows:,} records); {steps_path} ({n_steps:,} steps)", file=sys.stderr)
        return 0
    doc = trace_events(batch, steps)
    text = json.dumps(doc, separators=(",", ":"))
    if args.output == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"otel-llm export: {args.output} ({len(doc['traceEvents']):,} events)", file=sys.stderr)
    return 0
