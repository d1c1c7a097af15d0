"""The ``otel-llm`` command.

The core contributes ``analyze``; other packages add subcommands through the entry-point group
``otel_llm.commands`` (each entry point is ``register(subparsers) -> None``), so the core never
imports ``collector`` or ``engine_hooks``. Timeline sources other than a file (``--store``) come
from the group ``otel_llm.timeline_sources`` (``load(path, boundary) -> TimelineBatch``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from .percentiles import METHODS, as_fraction
from .report import FORMATS, format_summary
from .slo import SLO
from .summary import DEFAULT_PERCENTILES, summarize
from .timeline import BOUNDARIES, TimelineBatch
from .timeline_file import TimelineFormatError, read_timelines
from .window import Window

EXIT_USAGE = 2


class CLIError(Exception):
    """A user error: printed as ``otel-llm: message`` with exit code 2."""


def _percentile_list(text: str) -> list[str]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            as_fraction(part)
        except (ValueError, ZeroDivisionError):
            raise argparse.ArgumentTypeError(f"bad percentile {part!r}: expected numbers in [0, 100]") from None
        out.append(part)
    if not out:
        raise argparse.ArgumentTypeError("no percentiles given")
    return out


def _window(text: str) -> Window:
    try:
        return Window.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_analysis_options(p: argparse.ArgumentParser) -> None:
    """The window / SLO / percentile / format options shared by every command that summarises."""
    g = p.add_argument_group("analysis")
    g.add_argument(
        "--window",
        type=_window,
        metavar="W0,W1",
        help="observation window in seconds on the data's clock, edges inclusive "
        "(default: earliest submit to latest end)",
    )
    g.add_argument(
        "--slo",
        metavar="BOUNDS",
        default=None,
        help="goodput SLO, upper bounds in seconds, any subset of ttft=,tpot=,itl_max=,e2e= (e.g. ttft=1,tpot=0.05)",
    )
    g.add_argument(
        "--percentiles",
        type=_percentile_list,
        default=list(DEFAULT_PERCENTILES),
        metavar="P,P,...",
        help="percentiles to report (default: 50,90,95,99)",
    )
    g.add_argument(
        "--percentile-method",
        choices=METHODS,
        default="nearest-rank",
        help="nearest-rank (exact, default) or linear interpolation (numpy's default)",
    )
    g.add_argument(
        "--tpot-undefined",
        choices=("pass", "fail"),
        default="pass",
        help="whether a request with <= 1 output token passes a tpot bound (default: pass)",
    )
    g.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")


def analysis_text(batch: TimelineBatch, args: argparse.Namespace, extra: dict | None = None) -> str:
    """Summarise ``batch`` with the options of :func:`add_analysis_options` and format it."""
    try:
        slo = SLO.parse(args.slo, args.tpot_undefined) if args.slo else None
    except ValueError as exc:
        raise CLIError(f"--slo: {exc}") from None
    s = summarize(batch, window=args.window, slo=slo, ps=args.percentiles, method=args.percentile_method)
    if extra:
        s.extra.update(extra)
    return format_summary(s, args.format)


def load_source(name: str):
    for ep in entry_points(group="otel_llm.timeline_sources"):
        if ep.name == name:
            return ep.load()
    raise CLIError(f"no timeline source {name!r} is installed (is the collector package installed?)")


def _cmd_analyze(args: argparse.Namespace) -> int:
    if sum(x is not None for x in (args.file, args.store, args.traces)) != 1:
        raise CLIError("analyze: give one of a TIMELINES.jsonl file, --store PATH or --traces FILE")
    if args.store is not None or args.traces is not None:
        kind, path = ("store", args.store) if args.store is not None else ("traces", args.traces)
        try:
            batch = load_source(kind)(path, args.boundary)
        except (OSError, ValueError) as exc:  # the data layer says what is wrong; this is the CLI's exit 2
            raise CLIError(str(exc)) from None
        if len(batch) == 0:
            raise CLIError(f"{path}: no {args.boundary}-boundary requests in the {kind}")
    else:
        batch = read_timelines(args.file)
    sys.stdout.write(analysis_text(batch, args))
    return 0


def _register_analyze(sub) -> None:
    p = sub.add_parser(
        "analyze",
        help="latency, throughput and goodput from request timelines",
        description="Compute TTFT, ITL, TPOT, E2E, throughput and goodput (spec/metrics.md) from "
        "per-request timelines: a JSON-lines file, or the collector's store.",
        epilog='Input line: {"id": "a", "submit": 0.0, "end": 0.18, "status": "ok", '
        '"events": [[0.1, 1], [0.13, 1], [0.17, 1]], "input_tokens": 12} (seconds; status ok, '
        "error, cancelled or rejected; events are [time, tokens] pairs in any order). "
        "Bad input exits with code 2 naming the file and line.",
    )
    p.add_argument("file", nargs="?", metavar="TIMELINES.jsonl", help="timelines file ('-' for stdin)")
    p.add_argument("--store", metavar="PATH", help="read the collector's per-request store instead of a file")
    p.add_argument(
        "--traces",
        metavar="FILE",
        help="derive from a traces file (OTLP JSON lines, as OTEL_LLM_TRACES_FILE writes them)",
    )
    p.add_argument(
        "--boundary",
        choices=BOUNDARIES,
        default="client",
        help="with --store or --traces: which boundary's records to analyse (default: client)",
    )
    add_analysis_options(p)
    p.set_defaults(func=_cmd_analyze)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="otel-llm",
        description="OpenTelemetry tracing and latency metrics (TTFT, ITL, TPOT, E2E, goodput) for LLM inference.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _register_analyze(sub)
    from .bench import register as _register_bench

    _register_bench(sub)
    for ep in sorted(entry_points(group="otel_llm.commands"), key=lambda e: e.name):
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken plugin must not take the whole CLI down
            print(f"otel-llm: warning: subcommand plugin {ep.name!r} failed to load: {exc}", file=sys.stderr)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except (CLIError, TimelineFormatError) as exc:
        print(f"otel-llm: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
