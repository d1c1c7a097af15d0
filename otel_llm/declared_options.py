"""Command-line options declared once, as dataclass fields, each also an environment variable.

A field made with :func:`option` is a command-line option (``flag``) and a variable (its command's
prefix + the option, e.g. ``OTEL_LLM_COLLECTOR_MAX_TRACES``, ``OTEL_LLM_BENCH_RATE``); the command
line wins. :func:`add_options` builds a command's parser from a dataclass's fields (their argument
groups and mutually exclusive groups too), and :func:`settle` finishes what a parser cannot know:
the variables of a mutually exclusive group, taken only where the command line set none of its
options, and the options a run cannot go without. ``otel-llm collector`` and ``otel-llm bench``
declare theirs here; docs/commands.md and docs/configuration.md are checked against them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import field, fields
from typing import Any

from . import environment


def option(
    default: Any,
    flag: str,
    metavar: str,
    help: str,
    parse: Callable[[str], Any] = str,
    minimum=None,
    *,
    group: str | None = None,
    exclusive: str | None = None,
    required: bool = False,
    switch: bool = False,
    unset: str | None = None,
):
    """A field that is also a command-line option and an environment variable. ``parse`` turns
    the text into the field's value (ValueError: bad text); ``minimum`` bounds a number. ``group``:
    the ``--help`` section it is listed under; ``exclusive``: the name of the mutually exclusive
    group it belongs to; ``required``: the option (or one of its exclusive group) must be given,
    on the command line or by its variable; ``switch``: an option without a value (its variable
    takes true/false); ``unset``: what ``--help`` calls a default of None (none: not shown)."""
    meta = {
        "flag": flag,
        "metavar": metavar,
        "help": help,
        "parse": parse,
        "minimum": minimum,
        "group": group,
        "exclusive": exclusive,
        "required": required,
        "switch": switch,
        "unset": unset,
    }
    return field(default=default, metadata=meta)


def options_of(cls) -> list:
    """The fields of a dataclass that are options."""
    return [f for f in fields(cls) if "flag" in f.metadata]


def check_minimums(obj) -> None:
    """ValueError where a number option of ``obj`` is below its minimum."""
    for f in options_of(type(obj)):
        low, v = f.metadata["minimum"], getattr(obj, f.name)
        if low is not None and v is not None and v < low:
            raise ValueError(f"{f.metadata['flag']} must be >= {low}, got {v}")


def checked(f) -> Callable[[str], Any]:
    """The option's text -> its value, ValueError where it does not parse or is below its minimum."""
    m = f.metadata
    parse, low = (yes_no if m["switch"] else m["parse"]), m["minimum"]

    def check(text: str):
        v = parse(text)
        if low is not None and v is not None and v < low:
            raise ValueError(f"must be >= {low}")
        return v

    return check


def yes_no(text: str) -> bool:
    """A switch's text: true/false, yes/no, on/off, 1/0."""
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


def one_of(*choices: str) -> Callable[[str], str]:
    """A parser for an option taking one of ``choices`` (any case)."""

    def parse(text: str) -> str:
        t = text.strip().lower()
        if t not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return t

    parse.choices = choices
    return parse


def above(low: float) -> Callable[[str], float]:
    """A parser for a number option that must be over ``low`` (a finite number)."""

    def parse(text: str) -> float:
        v = float(text)
        if not v > low or v == float("inf"):
            raise ValueError(f"must be > {low:g}")
        return v

    return parse


def add_option(p, f, var: str) -> None:
    """One option on ``p`` (a parser or a group) from field ``f``: the command line converts with
    the field's parser (a usage error when it fails); outside a mutually exclusive group, its
    variable gives the default (logged and ignored when it does not parse)."""
    m = f.metadata
    check = checked(f)

    def convert(text: str):
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    default = f.default if m["exclusive"] else environment.parsed(var, f.default, check)
    shown = m["unset"] if default is None else None if m["switch"] and not default else default
    help = m["help"] + (f" (default {shown}; ${var})" if shown is not None else f" (${var})")
    if m["switch"]:
        p.add_argument(m["flag"], dest=f.name, action="store_true", default=default, help=help)
    else:
        p.add_argument(m["flag"], dest=f.name, type=convert, default=default, metavar=m["metavar"], help=help)


def add_options(p: argparse.ArgumentParser, cls, variable: Callable[[str], str]) -> None:
    """Every option of dataclass ``cls`` on parser ``p``, in declaration order, in their groups;
    ``variable(flag)`` names each one's environment variable."""
    groups: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    for f in options_of(cls):
        m = f.metadata
        where = p
        if m["group"]:
            if m["group"] not in groups:
                groups[m["group"]] = p.add_argument_group(m["group"])
            where = groups[m["group"]]
        if m["exclusive"]:
            if m["exclusive"] not in exclusive:
                exclusive[m["exclusive"]] = where.add_mutually_exclusive_group()
            where = exclusive[m["exclusive"]]
        add_option(where, f, variable(m["flag"]))


def _unset(value) -> bool:
    """An option left at no value: None, or a switch not given (0 is a value)."""
    return value is None or value is False


def settle(args: argparse.Namespace, cls, variable: Callable[[str], str]) -> None:
    """After parsing: each mutually exclusive group none of whose options the command line set
    takes its variables (ValueError where two of them are set), then each required option or group
    must have a value (ValueError naming the options and their variables)."""
    by_group: dict[str, list] = {}
    for f in options_of(cls):
        if f.metadata["exclusive"]:
            by_group.setdefault(f.metadata["exclusive"], []).append(f)
    for members in by_group.values():
        if not all(_unset(getattr(args, f.name)) for f in members):
            continue
        given = [(f, environment.raw(variable(f.metadata["flag"]))) for f in members]
        given = [(f, text) for f, text in given if text is not None and text.strip()]
        if len(given) > 1:
            raise ValueError(" and ".join(f"${variable(f.metadata['flag'])}" for f, _ in given) + " are both set")
        for f, text in given:
            try:
                setattr(args, f.name, checked(f)(text.strip()))
            except ValueError as exc:
                raise ValueError(f"${variable(f.metadata['flag'])}={text!r}: {exc}") from None
    needed = [f for f in options_of(cls) if f.metadata["required"]]
    for key in dict.fromkeys(f.metadata["exclusive"] or f.name for f in needed):
        alts = [f for f in needed if (f.metadata["exclusive"] or f.name) == key]
        if all(_unset(getattr(args, f.name)) for f in alts):
            names = ", ".join(f.metadata["flag"] for f in alts)
            variables = ", ".join("$" + variable(f.metadata["flag"]) for f in alts)
            raise ValueError(f"{'one of ' if len(alts) > 1 else ''}{names} is required (or {variables})")
