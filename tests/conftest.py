import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_cli(*args, check=True, input=None):
    """Run the installed ``otel-llm`` command in a subprocess, as a user would."""
    proc = subprocess.run([sys.executable, "-m", "otel_llm", *map(str, args)], capture_output=True,
                          text=True, input=input, cwd=ROOT, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"otel-llm {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def analyze_json(path, *args):
    return json.loads(run_cli("analyze", path, "--format", "json", *args).stdout)


@pytest.fixture
def jsonl(tmp_path):
    def make(rows, name="timelines.jsonl"):
        return write_jsonl(tmp_path / name, rows)
    return make
