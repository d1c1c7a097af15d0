"""Bad input stops with exit code 2 and a message naming the file, the line and the problem."""

import json

import pytest
from conftest import run_cli

GOOD = {"id": "a", "submit": 0.0, "end": 0.18, "status": "ok", "events": [[0.1, 1]]}


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("{not json", "malformed JSON"),
        (json.dumps([1, 2]), "expected a JSON object"),
        (json.dumps({**GOOD, "status": "done"}), "unknown status"),
        (json.dumps({**GOOD, "end": -1.0}), "before submit"),
        (json.dumps({**GOOD, "events": [[-0.5, 1]]}), "before submit"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "end"}), "missing key 'end'"),
        (json.dumps({**GOOD, "events": [[0.1, -1]]}), "non-negative integer"),
        (json.dumps({**GOOD, "submit": "zero"}), "finite number"),
    ],
)
def test_bad_line_names_file_line_and_problem(tmp_path, bad, problem):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + bad + "\n")
    proc = run_cli("analyze", path, check=False)
    assert proc.returncode == 2
    assert f"{path}:3:" in proc.stderr
    assert problem in proc.stderr
    assert proc.stdout == ""


def test_empty_file_says_so(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    proc = run_cli("analyze", path, check=False)
    assert proc.returncode == 2
    assert "empty" in proc.stderr and str(path) in proc.stderr


def test_missing_file(tmp_path):
    proc = run_cli("analyze", tmp_path / "nope.jsonl", check=False)
    assert proc.returncode == 2 and "cannot read" in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--slo", "ttft=fast"], "--slo"),
        (["--slo", "latency=1"], "--slo"),
        (["--slo", "bad name:ttft=1"], "bad SLO name"),
        (["--window", "5,1"], "W1 must be later"),
        (["--percentiles", "101"], "bad percentile"),
    ],
)
def test_bad_options(tmp_path, args, message):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    proc = run_cli("analyze", path, *args, check=False)
    assert proc.returncode == 2 and message in proc.stderr


def test_one_slo_grammar_everywhere(tmp_path):
    """The collector's named form (``--slo default:ttft=1``) means the same to analyze."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    plain = json.loads(run_cli("analyze", path, "--slo", "ttft=1,tpot=0.05", "--format", "json").stdout)
    named = json.loads(run_cli("analyze", path, "--slo", "default:ttft=1,tpot=0.05", "--format", "json").stdout)
    assert named["goodput"] == plain["goodput"] and plain["goodput"] is not None


def test_stdin_and_zero_token_chunks_are_not_events():
    row = {**GOOD, "events": [[0.05, 0], [0.1, 1], [0.15, 1]]}
    proc = run_cli("analyze", "-", "--format", "json", input=json.dumps(row) + "\n")
    out = json.loads(proc.stdout)
    assert out["latency"]["ttft"]["p50"] == pytest.approx(0.1)
    assert out["latency"]["itl"]["n"] == 1
