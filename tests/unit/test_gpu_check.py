"""benchmarks/gpu_check.py keeps working where CI runs (no GPU): its CPU path measures the same
things (plain vs instrumented rounds, step wall times, the hook cost) on the tiny model, and says
GPU time is not available rather than inventing it."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_the_gpu_check_runs_its_cpu_path(tmp_path):
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu"]
    cmd += ["--concurrency", "1,3", "--rounds", "2", "--tokens", "6", "--prompt", "8", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GPU time: n/a (no CUDA)" in proc.stdout and "budget: instrumented/plain >= 0.995" in proc.stdout
    got = json.loads(out.read_text())
    assert got["device"] == "CPU" and [r["concurrency"] for r in got["results"]] == [1, 3]
    for r in got["results"]:
        assert len(r["ratio_rounds"]) == 2 and all(x > 0 for x in r["ratio_rounds"])
        assert r["plain_tok_s"] > 0 and r["instrumented_tok_s"] > 0 and r["steps_ratio"] > 0
        # the budget's side runs at the default level; the step times come from the steps run
        assert r["detail"] == "phases"
        assert r["steps"] >= 5 and r["step_wall_ms_median"] > 0
        # every timed traced request has its span, with the tokens the engine gave it
        assert r["requests_traced"] == r["requests_run"] == 3 * r["concurrency"]
        assert r["tokens_traced"] == r["tokens_run"] == 6 * r["requests_run"]
        assert r["step_gpu_ms_median"] is None and r["steps_gpu_above_wall"] is None
        assert 0 < r["hook_us_per_step"] < 1000
    # through a span process to a trace file, as a user's process delivers: every request and step
    sp = got["span_process"]
    assert sp["requests"] == 3 and sp["tokens"] == sp["tokens_run"] == 3 * 6 and sp["steps"] >= 5
    assert sp["steps_gpu_timed"] == 0 and sp["span_process_cpu_s"] > 0  # the CPU: no GPU time
    assert "span process (3 requests, steps detail, trace file): 3/3 requests" in proc.stdout


def test_gpu_check_refuses_cuda_it_does_not_have():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "no CUDA device here" in proc.stderr
