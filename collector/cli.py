"""``otel-llm collector``: run the collector until SIGINT / SIGTERM (which flush to the store)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from otel_llm import environment
from otel_llm.cli_options import add_selection_options, number, percentile_list, selection_of
from otel_llm.percentiles import METHODS

from .config import AssemblyConfig, CollectorConfig, options_of, parse_slos


def _add_option(p: argparse.ArgumentParser, f) -> None:
    """One option from a configuration field (:func:`collector.config.option`): the command line
    converts with the field's parser (a usage error when it fails); its variable
    ``OTEL_LLM_COLLECTOR_<OPTION>`` gives the default (logged and ignored when it does not parse)."""
    m = f.metadata
    parse, low = m["parse"], m["minimum"]

    def check(text: str):
        v = parse(text)
        if low is not None and v is not None and v < low:
            raise ValueError(f"must be >= {low}")
        return v

    def convert(text: str):
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    var = environment.collector_variable(m["flag"])
    default = environment.parsed(var, f.default, check)
    shown = "off" if default is None else default
    p.add_argument(
        m["flag"],
        dest=f.name,
        type=convert,
        default=default,
        metavar=m["metavar"],
        help=f"{m['help']} (default {shown}; ${var})",
    )


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
    for f in options_of(CollectorConfig):
        _add_option(p, f)
    for f in options_of(AssemblyConfig):
        _add_option(p, f)
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
    from .stalls import DEFAULT_FACTOR, DEFAULT_FLOOR_S

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
    from .client_results import add_client_results_options

    p = sub.add_parser(
        "compare",
        help="client vs engine per request: where the client's TTFT went",
        description="From the collector's store: per request and as distributions, the client TTFT in its "
        "parts ([client_send +] network_in + api_in + front_end + queue + prefill + api_out + network_out with "
        "the HTTP server span; to_engine and delivery where it is missing); client vs engine ITL; the cause of "
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
        "allow one clock); a number applies it",
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
        "--top", type=number(int, 0), default=20, help="table/markdown: requests listed, slowest client TTFT first"
    )
    p.add_argument("--format", choices=("table", "json", "markdown"), default="table")
    add_client_results_options(p)
    add_selection_options(p)
    p.set_defaults(func=run_compare)


def _why_unpaired(records) -> str:
    """The likely cause, in words, of records none of which pair (for compare's refusal)."""
    by = {b: sum(1 for r in records if r.boundary == b) for b in ("client", "server", "engine")}
    counts = ", ".join(f"{n} {b}" for b, n in by.items())
    if not records:
        return "the store holds no records (is the collector the endpoint the client and the engine export to?)"
    if by["client"] and not by["engine"]:
        return (
            f"records: {counts}. The engine sent nothing: start it with OTEL_LLM_ENABLE=1 (vLLM's plugin) or "
            "instrument() it, and point OTEL_EXPORTER_OTLP_ENDPOINT at this collector"
        )
    if by["engine"] and not by["client"]:
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

    from .client_results import apply_client_results
    from .compare import compare, summarize_comparison, to_json
    from .compare_format import format_comparison
    from .store import read_stores

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
