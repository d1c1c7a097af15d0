"""Counting a process's work in instructions, one step at a time (callgrind).

The benchmarks that count one Python process without an engine (``http_span_cost.py``,
``hooks_cost.py``) run it under ``valgrind --tool=callgrind`` with counting off. It prints
``READY``, then for each line its parent writes (``GO ...``) does one step of work and prints
``DONE``; the parent switches counting on around each step (``callgrind_control``, as
``cost_count.py`` does for the engines) and reads that step's dump.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from cost_count import _control, _total  # noqa: E402


def parser(doc: str) -> argparse.ArgumentParser:
    """A counting benchmark's command line: its docstring as the help, and the hidden ``--drive``
    that makes it the counted process."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    return ap


def count_steps(script: str, steps: list[str], env: dict | None = None, args: tuple[str, ...] = ()) -> list[int]:
    """Instructions of each step ``GO <step>`` of ``script --drive *args``, run under callgrind
    with the project on its path and the same string hashes every run."""
    with tempfile.TemporaryDirectory(prefix="counted-") as out:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.%p"]
        cmd += [f"--log-file={out}/valgrind.log", sys.executable, os.path.abspath(script), "--drive", *args]
        run_env = dict(os.environ if env is None else env)
        run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, run_env.get("PYTHONPATH")]))
        run_env["PYTHONHASHSEED"] = "0"
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=run_env)
        counts = []
        try:
            if not _next_line(proc).startswith("READY"):
                raise RuntimeError(f"{script}: the counted process did not start ({_log(out)})")
            pid = str(proc.pid)
            for step in steps:
                _control("-z", pid)
                _control("-i", "on", pid)
                proc.stdin.write(f"GO {step}\n")
                proc.stdin.flush()
                if not _next_line(proc).startswith("DONE"):
                    raise RuntimeError(f"{script}: the counted process stopped ({_log(out)})")
                _control("-i", "off", pid)
                before = set(glob.glob(f"{out}/cg.{pid}.*"))
                _control("-d", step.replace(" ", "-"), pid)
                (dump,) = set(glob.glob(f"{out}/cg.{pid}.*")) - before
                counts.append(_total(dump))
                print(f"  {step}: {counts[-1]:,} instructions", flush=True)
        finally:
            proc.stdin.close()
            proc.wait(timeout=120)
        return counts


def _next_line(proc: subprocess.Popen) -> str:
    """The counted process's next line that says where it is (READY, DONE), or '' at its end."""
    for line in iter(proc.stdout.readline, ""):
        if line.startswith(("READY", "DONE")):
            return line
    return ""


def _log(out: str) -> str:
    try:
        with open(os.path.join(out, "valgrind.log")) as f:
            return f.read()[-2000:]
    except OSError:
        return "no valgrind log"
