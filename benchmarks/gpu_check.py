"""GPU check: transformers continuous batching, plain vs instrumented, and CUDA step times.

On a machine with one NVIDIA GPU (no network needed): a 1B-class Llama shape with random weights
in bf16, at 1, 16, 64 and 256 concurrent requests, plain and instrumented (engine_hooks.instrument,
GPU timer on) in alternating rounds. Prints per concurrency:

* instrumented / plain output-token throughput (budget: at least 0.99);
* the CUDA-event GPU time per step next to the wall time per step (GPU time never above wall
  time, and close to it when the step is GPU-bound);
* the hook cost per step on the engine's thread (microseconds).

Without CUDA (``--device cpu``, or auto on a machine without one) it runs the same code on the
project's tiny model in fp32 at small concurrency: what CI checks, so the script keeps working.

Run: ``python benchmarks/gpu_check.py`` (``make gpu-check``). Options: ``--device auto|cpu|cuda``,
``--concurrency 1,16,64,256``, ``--rounds 3``, ``--tokens 64``, ``--prompt 128``, ``--json FILE``.
Fits in five minutes on an H200 with the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--concurrency", default=None, help="comma list (default: 1,16,64,256 on CUDA; 1,4,16 on CPU)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per concurrency (default 3)")
    ap.add_argument("--tokens", type=int, default=None, help="output tokens per request (default 64; CPU 16)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens per request (default 128; CPU 32)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    a = ap.parse_args(argv)

    import cb_runs
    import torch

    device = a.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    gpu = device == "cuda"
    conc = [int(x) for x in (a.concurrency or ("1,16,64,256" if gpu else "1,4,16")).split(",")]
    tokens = a.tokens or (64 if gpu else 16)
    plen = a.prompt or (128 if gpu else 32)
    tiny = None if gpu else os.path.join(tempfile.mkdtemp(prefix="otel-llm-gpu-check-"), "tiny")
    shape = cb_runs.LLAMA_1B if gpu else None
    dtype = "bfloat16" if gpu else "float32"
    build = lambda: cb_runs.build_model(shape, device, dtype, tiny)
    t_start = time.perf_counter()
    what = "1B-class Llama shape, random weights, bf16" if gpu else "tiny random Llama, fp32 (the CPU path)"
    name = torch.cuda.get_device_name(0) if gpu else "CPU"
    print(f"device: {name}; model: {what}; {tokens} output tokens, {plen}-token prompts, {a.rounds} rounds", flush=True)
    model = build()
    traced = cb_runs.tracing(device)
    sync = torch.cuda.synchronize if gpu else None
    vocab = model.config.vocab_size
    results = []
    for n in conc:
        batch = cb_runs.prompts(n, plen, vocab)
        gen, cb = cb_runs.configs(tokens, n, plen)
        r = cb_runs.alternate(model, traced, batch, gen, cb, a.rounds, sync)
        hook = cb_runs.hook_cost_us(n)
        wall = statistics.median(r.step_wall_ms) if r.step_wall_ms else float("nan")
        g = statistics.median(r.step_gpu_ms) if r.step_gpu_ms else None
        over = sum(1 for gg, w in zip(r.step_gpu_ms, r.step_wall_ms) if gg > w * 1.001)
        row = {
            "concurrency": n,
            "plain_tok_s": statistics.median(r.plain),
            "instrumented_tok_s": statistics.median(r.traced),
            "ratio_median": statistics.median(r.ratios),
            "ratio_rounds": r.ratios,
            "ratio_all_rounds": r.ratio_all,
            "steps": r.steps,
            "step_wall_ms_median": wall,
            "step_gpu_ms_median": g,
            "steps_gpu_above_wall": over if g is not None else None,
            "hook_us_per_step": hook,
        }
        results.append(row)
        gtxt = f"GPU {g:.2f} ms/step (steps with GPU > wall: {over})" if g is not None else "GPU time: n/a (no CUDA)"
        print(
            f"concurrency {n:>4}: plain {row['plain_tok_s']:,.0f} tok/s, instrumented {row['instrumented_tok_s']:,.0f} "
            f"tok/s, ratio {row['ratio_median']:.3f} (rounds {', '.join(f'{x:.3f}' for x in r.ratios)}; "
            f"all rounds {r.ratio_all:.3f}); wall {wall:.2f} ms/step, {gtxt}; hook {hook:.1f} us/step",
            flush=True,
        )
    print(f"budget: instrumented/plain >= 0.99 at every concurrency; took {time.perf_counter() - t_start:.0f} s")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(
                {"device": name, "model": what, "tokens": tokens, "prompt": plen, "results": results}, fh, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
