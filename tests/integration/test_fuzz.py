"""The C walk under coverage-guided fuzzing (atheris, AddressSanitizer, UBSan), and the kept corpus
replayed without sanitizers on every quick run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.walk_diff import differential, needs_ext

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "fuzz" / "corpus"


@needs_ext
def test_kept_corpus_agrees_with_protobuf():
    """Every input the fuzzer kept (and the seeds: valid payloads, the issue's reproducer, nested,
    bad UTF-8, strindex) gives protobuf's answer."""
    files = sorted(CORPUS.iterdir())
    assert len(files) >= 40
    outcomes = {differential(f.read_bytes()) for f in files}
    assert (True, False) in outcomes and (False, True) in outcomes  # walked, and refused


@pytest.mark.slow
@pytest.mark.parallel_safe  # inputs tried, not time: beside other tests it tries fewer
@pytest.mark.skipif(shutil.which("clang") is None, reason="clang is installed by `make test` (make clang)")
def test_bounded_fuzz_run_finds_nothing():
    """Half a minute of libFuzzer over the sanitized walk (tests/fuzz/run.sh; `make fuzz` runs a
    minute, OTEL_LLM_FUZZ_SECONDS sets it here), from the kept corpus: no memory error, no
    undefined behaviour, no disagreement with protobuf, and the C code's coverage counters loaded."""
    env = {**os.environ, "PY": sys.executable, "FUZZ_SECONDS": os.environ.get("OTEL_LLM_FUZZ_SECONDS", "30")}
    p = subprocess.run(["bash", "tests/fuzz/run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    counters = int(re.search(r"Loaded 1 modules\s+\((\d+) inline 8-bit counters\)", out).group(1))
    runs = int(re.search(r"stat::number_of_executed_units:\s+(\d+)", out).group(1))
    assert counters > 300 and runs > 10_000, out[-2000:]
    print(f"fuzz: {runs} inputs, {counters} coverage counters in the C walk")
