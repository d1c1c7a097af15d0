"""What every ``otel-llm`` subcommand shares: the user-error exception, and the options (and their
parsing) of the commands that summarise. Subcommands in other packages import this module, not
the command itself."""

from __future__ import annotations

import argparse
import os

from .metrics.fluidity import FluidityTarget
from .metrics.percentiles import METHODS, as_fraction
from .metrics.selection import Selection, parse_time
from .metrics.slo import SLO
from .metrics.summary import DEFAULT_PERCENTILES, summarize
from .metrics.summary_format import FORMATS, format_summary
from .metrics.timeline import TimelineBatch
from .metrics.window import Window

EXIT_USAGE = 2


class CLIError(Exception):
    """A user error: printed as ``otel-llm: message`` with exit code 2."""


#: optional packages -> the extra of otel-llm that installs them (pyproject.toml)
EXTRA_OF = {
    "plotly": "report",
    "kaleido": "report",
    "pyarrow": "parquet",
    "vllm": "vllm",
    "transformers": "transformers",
    "torch": "torch",
}


def missing_extra(exc: ModuleNotFoundError, command: str | None) -> str | None:
    """The one line to print when a subcommand needs a package its install left out, or None when
    the missing module is not one an extra provides (a real bug: let it raise)."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return None
    return f"otel-llm {command or ''}: needs {top}, which this install leaves out: {install_hint(extra)}"


def install_hint(extra: str) -> str:
    """The command that adds ``extra`` to this install: from the source tree it runs from (a clone,
    installed with ``pip install -e``), else from the package index."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "pyproject.toml")):
        return f"pip install -e '{root}[{extra}]'"
    return f"pip install 'otel-llm[{extra}]'"


def check_output_path(path: str | None, flag: str = "-o") -> None:
    """Refuse an output file whose directory is missing (CLIError), before any work is done;
    ``-`` (standard output) and None pass."""
    if not path or path == "-":
        return
    where = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(where):
        raise CLIError(f"{flag} {path}: the directory {where} does not exist")


def number(kind: type, low: float, *, strict: bool = False):
    """An argparse type: a ``kind`` (int or float) >= ``low`` (> ``low`` when ``strict``)."""

    def convert(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if v != v or (v <= low if strict else v < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}, got {text}")
        return v

    convert.__name__ = kind.__name__
    return convert


def percentile_list(text: str) -> list[str]:
    """``--percentiles 50,90,99.9``: each a number in [0, 100] (an argparse type)."""
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
        help="observation window, edges inclusive: seconds on the data's clock, or ISO 8601 times; from a store "
        "or a traces file, seconds below 1e9 count from the selection's first submit (--window 0,60) "
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
        type=percentile_list,
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
    g.add_argument(
        "--fluidity",
        metavar="DEADLINES",
        default=None,
        help="the fluidity index (docs/metrics/fluidity.md) against token deadlines: ttft=S,tbt=S[,target=F]"
        "[,share=F] (seconds; a request is fluid at index >= target, default 0.9; the fluid token generation "
        "rate keeps a share of the requests fluid, default 0.99)",
    )
    g.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")


def slo_option(text: str | None, tpot_undefined: str = "pass") -> SLO | None:
    """The ``--slo [NAME:]BOUNDS`` option's SLO (None when not given; the name, as the collector's
    ``--slo`` takes it, is accepted and not needed); a bad one is a usage error."""
    try:
        return SLO.parse_named(text, tpot_undefined)[1] if text else None
    except ValueError as exc:
        raise CLIError(f"--slo: {exc}") from None


def fluidity_option(text: str | None) -> FluidityTarget | None:
    """The ``--fluidity DEADLINES`` option (None when not given); a bad one is a usage error."""
    try:
        return FluidityTarget.parse(text) if text else None
    except ValueError as exc:
        raise CLIError(f"--fluidity: {exc}") from None


def analysis_text(batch: TimelineBatch, args: argparse.Namespace, extra: dict | None = None) -> str:
    """Summarise ``batch`` with the options of :func:`add_analysis_options` and format it."""
    slo = slo_option(args.slo, args.tpot_undefined)
    flu = fluidity_option(getattr(args, "fluidity", None))
    s = summarize(batch, window=args.window, slo=slo, ps=args.percentiles, method=args.percentile_method, fluidity=flu)
    if extra:
        s.extra.update(extra)
    return format_summary(s, args.format)


def _time(text: str) -> int:
    try:
        return parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _trace_id(text: str) -> str:
    t = text.strip().lower()
    if len(t) != 32 or any(c not in "0123456789abcdef" for c in t):
        raise argparse.ArgumentTypeError(f"bad trace id {text!r}: expected 32 hex digits")
    return t


def add_selection_options(p: argparse.ArgumentParser) -> None:
    """Which records of a store or trace file a command reads (see :class:`Selection`)."""
    g = p.add_argument_group("selection (which of the records read are kept)")
    g.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="ID",
        help="only this otel-llm bench run (its run_id, printed by bench); repeatable",
    )
    g.add_argument(
        "--service",
        action="append",
        default=[],
        metavar="NAME",
        help="only records sent by this service.name; repeatable",
    )
    g.add_argument(
        "--trace",
        action="append",
        default=[],
        type=_trace_id,
        metavar="TRACE_ID",
        help="only the requests of this trace (32 hex digits, as Jaeger and compare --trace show it): an "
        "agent's or a chain's calls under one application span; repeatable",
    )
    g.add_argument(
        "--since",
        type=_time,
        metavar="TIME",
        help="only requests submitted at or after TIME (ISO 8601, e.g. 2026-12-01T09:30:00Z; or Unix s)",
    )
    g.add_argument("--until", type=_time, metavar="TIME", help="only requests submitted at or before TIME")
    g.add_argument(
        "--include-warmup",
        action="store_true",
        help="keep bench warm-up requests (left out by default, as bench leaves them out)",
    )


def selection_of(args: argparse.Namespace) -> Selection:
    if args.since is not None and args.until is not None and args.until < args.since:
        raise CLIError("--until is before --since")
    return Selection(
        tuple(args.run), tuple(args.service), args.since, args.until, args.include_warmup, tuple(args.trace)
    )


def selection_given(args: argparse.Namespace) -> bool:
    return bool(
        args.run
        or args.service
        or args.trace
        or args.since is not None
        or args.until is not None
        or args.include_warmup
    )


def load_source(name: str):
    """The ``otel_llm.timeline_sources`` entry point ``name`` (``load(path, boundary, selection)
    -> TimelineBatch``): the store and trace-file readers the collector package installs."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="otel_llm.timeline_sources"):
        if ep.name == name:
            return ep.load()
    raise CLIError(f"no timeline source {name!r} is installed (is the collector package installed?)")
