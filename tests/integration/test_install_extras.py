"""Every subcommand works after the install the README gives, or says in one line which extra to add.

A wheel of the project is built once; each case installs it into a fresh virtual environment with
one set of extras (none, ``report``, ``parquet``), from the package index as a user would, and runs
every subcommand for real on the demo store (tests/data): the ones whose packages are there must
succeed, the others must exit 2 with one line naming ``pip install 'otel-llm[EXTRA]'``, and none may
print a traceback."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.parallel_safe]  # pip and the CLI: no timing checked

#: what the project's wheel needs to be built from a copy of the tree
SOURCES = ("pyproject.toml", "setup.py", "README.md", "otel_llm", "engine_hooks", "collector")
STORE = ROOT / "tests" / "data" / "demo_store.db"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
        else:
            shutil.copy(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob("otel_llm-*.whl")
    return whl


def _venv(where, wheel, extra: str):
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=300)
    py = where / "bin" / "python"
    spec = f"{wheel}[{extra}]" if extra else str(wheel)
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", spec], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return where / "bin" / "otel-llm"


def _run(cli, *args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(cli), *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def _works_or_names(proc, needs: str | None, extras: str) -> None:
    """Exit 0 when the install has what the command needs; else exit 2 and one line naming the extra."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if needs is None or needs in extras:
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert f"pip install 'otel-llm[{needs}]'" in lines[0], lines


@pytest.mark.parametrize("extra", ["", "report", "parquet"])
def test_each_subcommand_after_installing_with(extra, wheel, tmp_path):
    cli = _venv(tmp_path / "venv", wheel, extra)
    store = tmp_path / "store.db"
    shutil.copy(STORE, store)
    top = _run(cli, "--help", cwd=tmp_path)
    assert top.returncode == 0 and "Traceback" not in top.stderr, top.stderr
    commands = ["analyze", "bench", "collector", "compare", "export", "report"]
    for command in commands:
        assert f"    {command}" in top.stdout, top.stdout  # every subcommand loaded
        h = _run(cli, command, "--help", cwd=tmp_path)
        assert h.returncode == 0 and "Traceback" not in h.stderr and h.stderr == "", (command, h.stderr)

    _works_or_names(_run(cli, "analyze", "--store", str(store), cwd=tmp_path), None, extra)
    _works_or_names(_run(cli, "compare", "--store", str(store), cwd=tmp_path), None, extra)
    perfetto = _run(cli, "export", "--store", str(store), "-o", str(tmp_path / "run.json"), cwd=tmp_path)
    _works_or_names(perfetto, None, extra)
    parquet = _run(
        cli, "export", "--store", str(store), "--format", "parquet", "-o", str(tmp_path / "r.parquet"), cwd=tmp_path
    )
    _works_or_names(parquet, "parquet", extra)
    report = _run(cli, "report", "--store", str(store), "-o", str(tmp_path / "report.html"), cwd=tmp_path)
    _works_or_names(report, "report", extra)
    # bench against a port nobody listens on: the one-line failure, not a traceback
    bench = _run(
        cli, "bench", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--num-requests", "2", cwd=tmp_path
    )
    assert bench.returncode != 0 and "Traceback" not in bench.stderr, bench.stderr[-3000:]
    # the collector starts, listens and stops on SIGTERM
    col = subprocess.Popen(
        [str(cli), "collector", "--otlp-grpc", "127.0.0.1:0", "--otlp-http", "127.0.0.1:0"]
        + ["--prometheus", "127.0.0.1:0", "--store", str(tmp_path / "col.db")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(8)
    assert col.poll() is None, col.communicate()[1][-3000:]
    col.send_signal(signal.SIGTERM)
    _, err = col.communicate(timeout=60)
    assert col.returncode == 0 and "Traceback" not in err, err[-3000:]
