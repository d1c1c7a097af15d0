"""Configuration: every collector option is also an environment variable, bad values are named,
and the configuration dataclasses refuse what they cannot run with."""

import logging

import pytest
from conftest import run_cli

from collector.cli import config_from_args
from collector.config import (
    AssemblyConfig,
    CollectorConfig,
    address,
    fluidity_or_off,
    options_of,
    policy_or_off,
    text_or_off,
    yes_no,
)
from collector.exporters.trace_policy import TracePolicy
from otel_llm import environment
from otel_llm.cli import build_parser
from otel_llm.cli_options import CLIError
from otel_llm.metrics.fluidity import FluidityTarget


def _sample(f) -> tuple[str, object]:
    """A value for option field ``f`` that differs from its default: (text, parsed value)."""
    parse, low = f.metadata["parse"], f.metadata["minimum"]
    if parse is address:
        return "127.0.0.1:1234", "127.0.0.1:1234"
    if parse is text_or_off:
        return "x", "x"
    if parse is yes_no:
        return "true", True
    if parse is fluidity_or_off:
        return "ttft=1,tbt=0.05", FluidityTarget(1.0, 0.05)
    if parse is policy_or_off:
        return "error,ratio=0.1", TracePolicy(error=True, ratio=0.1)
    if hasattr(parse, "choices"):
        other = next(c for c in parse.choices if c != f.default)
        return other.upper(), other
    v = parse(low if low is not None else 1) + parse(5)
    return str(v), v


def _parse(*argv):
    return build_parser().parse_args(["collector", *argv])


ALL = options_of(CollectorConfig) + options_of(AssemblyConfig)


@pytest.mark.parametrize("f", ALL, ids=[f.metadata["flag"] for f in ALL])
def test_every_option_is_also_a_variable(f, monkeypatch):
    text, value = _sample(f)
    var = environment.collector_variable(f.metadata["flag"])
    assert var.startswith("OTEL_LLM_COLLECTOR_")
    monkeypatch.setenv(var, text)
    assert getattr(_parse(), f.name) == value  # the variable sets the default
    assert getattr(_parse(f.metadata["flag"], text), f.name) == value  # the option takes the same text


def test_help_names_the_variable_of_every_option():
    out = run_cli("collector", "--help").stdout
    flags = [f.metadata["flag"] for f in ALL] + ["--slo", "--tpot-undefined"]
    for flag in flags:
        assert flag in out and environment.collector_variable(flag) in out.replace("\n", "").replace(" ", ""), flag


def test_slo_and_tpot_variables(monkeypatch):
    monkeypatch.setenv("OTEL_LLM_COLLECTOR_SLO", "fast:ttft=0.5;slow:e2e=10")
    monkeypatch.setenv("OTEL_LLM_COLLECTOR_TPOT_UNDEFINED", "fail")
    cfg = config_from_args(_parse())
    assert sorted(cfg.slos) == ["fast", "slow"] and cfg.slos["fast"].tpot_undefined == "fail"
    assert sorted(config_from_args(_parse("--slo", "x:ttft=1")).slos) == ["x"]  # the command line wins


def test_a_bad_variable_is_named_and_the_default_used(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_LLM_COLLECTOR_MAX_TRACES", "abc")
    with caplog.at_level(logging.WARNING, logger="otel_llm"):
        args = _parse()
    assert args.max_traces == AssemblyConfig().max_traces
    assert "OTEL_LLM_COLLECTOR_MAX_TRACES" in caplog.text and "'abc'" in caplog.text
    # the subcommand is still there, and says so in a subprocess too
    proc = run_cli("collector", "--help", env={"OTEL_LLM_COLLECTOR_MAX_TRACES": "abc"})
    assert "usage: otel-llm collector" in proc.stdout and "failed to load" not in proc.stderr
    assert "OTEL_LLM_COLLECTOR_MAX_TRACES='abc'" in proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-traces", "abc"], "argument --max-traces: 'abc'"),
        (["--max-traces", "0"], "must be >= 1"),
        (["--otlp-http", "127.0.0.1:99999"], "port from 0 to 65535"),
        (["--otlp-grpc", "nohost"], "expected HOST:PORT"),
        (["--trace-grace", "-1"], "must be >= 0"),
        (["--metrics-interval", "x"], "argument --metrics-interval"),
    ],
)
def test_bad_options_are_usage_errors(argv, message):
    proc = run_cli("collector", *argv, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_options_that_only_fail_together():
    with pytest.raises(CLIError, match="--tls-cert and --tls-key go together"):
        config_from_args(_parse("--tls-cert", "cert.pem"))
    with pytest.raises(CLIError, match="SLO 'a' given twice"):
        config_from_args(_parse("--slo", "a:ttft=1", "--slo", "a:e2e=1"))


def test_the_dataclasses_validate_themselves():
    with pytest.raises(ValueError, match="--max-traces must be >= 1"):
        AssemblyConfig(max_traces=0)
    with pytest.raises(ValueError, match="--trace-grace must be >= 0"):
        AssemblyConfig(grace_s=-0.5)
    with pytest.raises(ValueError, match="bad address"):
        CollectorConfig(prometheus="localhost")
    with pytest.raises(ValueError, match="--max-message-bytes must be >= 1024"):
        CollectorConfig(max_message_bytes=10)
    assert CollectorConfig(otlp_grpc=None, prometheus=None).receiver.max_message_bytes == 4 * 2**20


def test_environment_helpers_log_and_fall_back(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_LLM_X", "12")
    assert environment.env_int("OTEL_LLM_X", 3) == 12
    monkeypatch.setenv("OTEL_LLM_X", "twelve")
    with caplog.at_level(logging.WARNING, logger="otel_llm"):
        assert environment.env_int("OTEL_LLM_X", 3) == 3
        assert environment.env_int("OTEL_LLM_Y", 4) == 4  # unset: the default, silently
    assert caplog.text.count("OTEL_LLM_X") == 1
    monkeypatch.setenv("OTEL_LLM_X", "-1")
    assert environment.env_int("OTEL_LLM_X", 3, minimum=0) == 3
    for v, want in (("TRUE", True), ("off", False), ("maybe", True)):
        monkeypatch.setenv("OTEL_LLM_X", v)
        assert environment.env_bool("OTEL_LLM_X", True) is want


def test_engine_hooks_read_their_own_variables(monkeypatch, caplog):
    from engine_hooks.pipeline import TracingPipeline

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "9000")  # the SDK's processor's, not the hooks'
    monkeypatch.setenv("OTEL_LLM_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_LLM_MAX_QUEUE_SIZE", "1000")
    p = TracingPipeline(None)
    assert p.interval_s == 0.05 and p.recorder.capacity == 1000
    monkeypatch.setenv("OTEL_LLM_SCHEDULE_DELAY", "soon")
    with caplog.at_level(logging.WARNING, logger="otel_llm"):
        assert TracingPipeline(None).interval_s == 0.2
    assert "OTEL_LLM_SCHEDULE_DELAY='soon'" in caplog.text


def test_destination_names_where_spans_go(monkeypatch):
    from otel_llm.otlp.export import destination

    for v in (
        "OTEL_LLM_TRACES_FILE",
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ):
        monkeypatch.delenv(v, raising=False)
    assert destination() == "OTLP/HTTP http://localhost:4318/v1/traces"  # the SDK's default
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    assert destination() == "OTLP/HTTP http://collector:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert destination() == "OTLP/gRPC http://collector:4318/"
    monkeypatch.setenv("OTEL_LLM_TRACES_FILE", "/tmp/t.jsonl")
    assert destination() == "the file /tmp/t.jsonl (OTLP JSON lines)"


def test_metrics_auth_is_a_choice(make_collector):
    import urllib.error
    import urllib.request

    with pytest.raises(ValueError, match="--metrics-auth needs --auth-token"):
        CollectorConfig(metrics_auth=True)
    open_c = make_collector(auth_token="t0k")  # the default: /metrics stays open to a scraper
    url = f"http://127.0.0.1:{open_c.prometheus.address[1]}/metrics"
    assert urllib.request.urlopen(url, timeout=5).status == 200
    c = make_collector(auth_token="t0k", metrics_auth=True)
    url = f"http://127.0.0.1:{c.prometheus.address[1]}/metrics"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=5)
    assert err.value.code == 401
    req = urllib.request.Request(url, headers={"Authorization": "Bearer t0k"})
    assert b"otel_llm_collector_receiver_requests_total" in urllib.request.urlopen(req, timeout=5).read()
