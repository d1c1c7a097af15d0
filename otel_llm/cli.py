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

from .cli_options import (
    EXIT_USAGE,
    CLIError,
    add_analysis_options,
    add_selection_options,
    analysis_text,
    load_source,
    missing_extra,
    selection_given,
    selection_of,
)
from .metrics.timeline import BOUNDARIES
from .metrics.timeline_file import TimelineFormatError, read_timelines
from .semconv import Boundary


def _cmd_analyze(args: argparse.Namespace) -> int:
    if sum(x is not None for x in (args.file, args.store, args.traces)) != 1:
        raise CLIError("analyze: give one of a TIMELINES.jsonl file, --store PATH or --traces FILE")
    extra = None
    if args.store is not None or args.traces is not None:
        kind, path = ("store", args.store) if args.store is not None else ("traces", args.traces)
        if kind == "store" and len(path) == 1:
            path = path[0]
        sel = selection_of(args)
        try:
            batch = load_source(kind)(path, args.boundary, sel)
        except (OSError, ValueError) as exc:  # the data layer says what is wrong; this is the CLI's exit 2
            raise CLIError(str(exc)) from None
        if len(batch) == 0:
            where = path if isinstance(path, str) else ", ".join(path)
            others = [b for b in Boundary.ALL if b != args.boundary and len(load_source(kind)(path, b, sel))]
            hint = f" (it has {' and '.join(others)} records: --boundary {others[0]})" if others else ""
            which = " that match the selection" if selection_given(args) else ""
            noun = "traces file" if kind == "traces" else "store"
            raise CLIError(f"{where}: the {noun} holds no {args.boundary}-boundary requests{which}{hint}")
        if args.window is not None and args.window.relative:  # --window 0,60: from the selection's start
            args.window = args.window.after(float(batch.submit.min()))
        extra = {"selection": sel.describe()} if selection_given(args) else None
    else:
        if selection_given(args):
            raise CLIError(
                "--run, --service, --trace, --since, --until and --include-warmup select from --store or --traces"
            )
        batch = read_timelines(args.file)
    sys.stdout.write(analysis_text(batch, args, extra))
    return 0


def _register_analyze(sub) -> None:
    p = sub.add_parser(
        "analyze",
        help="latency, throughput and goodput from request timelines",
        description="Compute TTFT, ITL, TPOT, E2E, throughput and goodput (docs/metrics/spec.md) from "
        "per-request timelines: a JSON-lines file, or the collector's store.",
        epilog='Input line: {"id": "a", "submit": 0.0, "end": 0.18, "status": "ok", '
        '"events": [[0.1, 1], [0.13, 1], [0.17, 1]], "input_tokens": 12} (seconds; status ok, '
        "error, cancelled or rejected; events are [time, tokens] pairs in any order). "
        "Bad input exits with code 2 naming the file and line.",
    )
    p.add_argument("file", nargs="?", metavar="TIMELINES.jsonl", help="timelines file ('-' for stdin)")
    p.add_argument(
        "--store",
        metavar="PATH",
        action="append",
        help="read the collector's per-request store instead of a file; repeat it (or give a glob, quoted) for "
        "the stores of several collectors: the numbers are those of one store holding every record",
    )
    p.add_argument(
        "--traces",
        metavar="FILE",
        help="derive from a traces file (OTLP JSON lines, as OTEL_LLM_TRACES_FILE writes them)",
    )
    p.add_argument(
        "--boundary",
        choices=BOUNDARIES,
        default=Boundary.CLIENT,
        help="with --store or --traces: which boundary's records to analyse (default: client)",
    )
    add_analysis_options(p)
    add_selection_options(p)
    p.set_defaults(func=_cmd_analyze)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="otel-llm",
        description="OpenTelemetry tracing and latency metrics (TTFT, ITL, TPOT, E2E, goodput) for LLM inference.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _register_analyze(sub)
    from .bench.command import register as _register_bench

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
    except ModuleNotFoundError as exc:  # an optional package: say which extra installs it
        line = missing_extra(exc, args.command)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
