"""What a user gets wrong, the commands say in a line (exit 2), never with a traceback."""

import os
import socket

import pytest
from conftest import run_cli

OFF = ["--otlp-grpc", "off", "--otlp-http", "off", "--prometheus", "off"]


def _fails(*args, message: str):
    proc = run_cli(*args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.fixture
def not_a_store(tmp_path):
    p = tmp_path / "notes.db"
    p.write_text("these are my notes, not a database\n" * 10)
    return str(p)


def test_a_file_that_is_not_a_store(not_a_store):
    for cmd in (["analyze", "--store", not_a_store], ["compare", "--store", not_a_store]):
        _fails(*cmd, message="not an otel-llm store")
    _fails("collector", *OFF, "--store", not_a_store, message="not an otel-llm store")
    with open(not_a_store) as fh:
        assert fh.read().startswith("these are my notes")  # and it is left as it was


def test_a_store_in_a_directory_that_does_not_exist_is_not_created(tmp_path):
    missing = tmp_path / "typo" / "dir" / "x.db"
    _fails("collector", *OFF, "--store", str(missing), message="does not exist")
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize(
    "flag, name",
    [
        ("--otlp-http", "OTLP/HTTP receiver"),
        ("--otlp-grpc", "OTLP/gRPC receiver"),
        ("--prometheus", "Prometheus endpoint"),
    ],
)
def test_an_address_in_use_is_named(flag, name):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        args = {"--otlp-grpc": "off", "--otlp-http": "off", "--prometheus": "off", flag: f"127.0.0.1:{port}"}
        _fails(
            "collector",
            "--store",
            "off",
            *[x for kv in args.items() for x in kv],
            message=f"{name} cannot listen on 127.0.0.1:{port}",
        )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--stall", "-1"], "argument --stall: must be > 0"),
        (["--stall", "0"], "argument --stall: must be > 0"),
        (["--top", "-1"], "argument --top: must be >= 0"),
        (["--percentiles", "99.9,abc"], "bad percentile 'abc'"),
        (["--clock-offset", "soon"], "--clock-offset: 'auto' or a number"),
    ],
)
def test_compare_checks_its_options(flags, message):
    store = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "demo_store.db")
    _fails("compare", "--store", store, *flags, message=message)
