"""``otel-llm bench``'s options, declared once (otel_llm/bench/bench_options.py): each is also an
``OTEL_LLM_BENCH_<OPTION>`` variable, the command line wins, a mutually exclusive group takes its
variable only where the command line set none of its options, and what a run cannot go without
is named with its variables."""

from __future__ import annotations

import pytest
from conftest import run_cli

from otel_llm import environment
from otel_llm.bench.bench_options import BenchOptions
from otel_llm.bench.command import settle_options
from otel_llm.cli import build_parser
from otel_llm.cli_options import CLIError
from otel_llm.declared_options import options_of

ALL = options_of(BenchOptions)
NEEDED = ("--base-url", "http://127.0.0.1:9/v1", "--model", "m")


def _sample(f) -> tuple[str, object]:
    """A text for option ``f`` other than its default, and the value it parses to."""
    m = f.metadata
    if m["switch"]:
        return "true", True
    if hasattr(m["parse"], "choices"):
        other = next(c for c in m["parse"].choices if c != f.default)
        return other.upper(), other
    if m["parse"] in (int, float) or m["parse"].__name__ == "parse":  # numbers (above(): a closure)
        v = (f.default or 1) * 2 if f.default else 3
        return str(v), float(v) if m["parse"] is not int else int(v)
    return "some-text", "some-text"


def _args(*argv):
    args = build_parser().parse_args(["bench", *argv])
    settle_options(args)
    return args


def test_the_declaration_is_every_option_of_the_command():
    out = run_cli("bench", "--help").stdout.replace("\n", "").replace(" ", "")
    for f in ALL:
        assert f.metadata["flag"] in out and environment.bench_variable(f.metadata["flag"]) in out
    assert len(ALL) >= 40


@pytest.mark.parametrize("f", ALL, ids=[f.metadata["flag"] for f in ALL])
def test_every_option_is_also_a_variable(f, monkeypatch):
    text, value = _sample(f)
    var = environment.bench_variable(f.metadata["flag"])
    assert var.startswith("OTEL_LLM_BENCH_")
    load = () if f.metadata["exclusive"] == "load" else ("--concurrency", "2")
    rest = () if f.name in ("base_url", "model") else NEEDED
    monkeypatch.setenv(var, text)
    if f.name in ("base_url", "model"):  # the other one on the command line
        rest = ("--model", "m") if f.name == "base_url" else ("--base-url", "http://h/v1")
    assert getattr(_args(*rest, *load), f.name) == value  # the variable gives the value
    argv = () if f.metadata["switch"] else (text,)
    assert getattr(_args(*rest, *load, f.metadata["flag"], *argv), f.name) == value  # so does the option


def test_the_command_line_wins_over_an_exclusive_groups_variable(monkeypatch):
    monkeypatch.setenv("OTEL_LLM_BENCH_RATE", "4")
    monkeypatch.setenv("OTEL_LLM_BENCH_DURATION", "30")
    args = _args(*NEEDED, "--concurrency", "2", "--num-requests", "5")
    assert (args.rate, args.concurrency, args.duration, args.num_requests) == (None, 2, None, 5)
    args = _args(*NEEDED)
    assert (args.rate, args.concurrency, args.duration, args.num_requests) == (4.0, None, 30.0, None)
    monkeypatch.setenv("OTEL_LLM_BENCH_WARMUP", "3")
    assert _args(*NEEDED).warmup == 3 and _args(*NEEDED, "--warmup", "1").warmup == 1


def test_what_a_run_cannot_go_without_is_named_with_its_variables(monkeypatch):
    with pytest.raises(CLIError, match=r"one of --rate, --concurrency, --sweep, --find-capacity, --replay is required"):
        _args(*NEEDED)
    with pytest.raises(CLIError, match=r"--model is required \(or \$OTEL_LLM_BENCH_MODEL\)"):
        _args("--base-url", "http://h/v1", "--rate", "1")
    monkeypatch.setenv("OTEL_LLM_BENCH_RATE", "4")
    monkeypatch.setenv("OTEL_LLM_BENCH_CONCURRENCY", "2")
    with pytest.raises(CLIError, match=r"\$OTEL_LLM_BENCH_RATE and \$OTEL_LLM_BENCH_CONCURRENCY are both set"):
        _args(*NEEDED)
    monkeypatch.delenv("OTEL_LLM_BENCH_CONCURRENCY")
    monkeypatch.setenv("OTEL_LLM_BENCH_RATE", "fast")
    with pytest.raises(CLIError, match=r"\$OTEL_LLM_BENCH_RATE='fast'"):
        _args(*NEEDED)
    proc = run_cli("bench", *NEEDED, check=False, env={"OTEL_LLM_BENCH_RATE": ""})
    assert proc.returncode == 2 and "one of --rate" in proc.stderr  # a usage error, exit 2


def test_a_bad_variable_outside_a_group_is_named_and_the_default_used(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_LLM_BENCH_SEED", "abc")
    assert _args(*NEEDED, "--rate", "1").seed == 0
    assert "OTEL_LLM_BENCH_SEED" in caplog.text


def test_the_api_key_falls_back_to_openais_variable(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    assert _args(*NEEDED, "--rate", "1").api_key == "sk-openai"
    monkeypatch.setenv("OTEL_LLM_BENCH_API_KEY", "sk-bench")
    assert _args(*NEEDED, "--rate", "1").api_key == "sk-bench"
    assert _args(*NEEDED, "--rate", "1", "--api-key", "sk-cli").api_key == "sk-cli"
