"""GPU check: transformers continuous batching, plain vs instrumented, and CUDA step times.

On a machine with one NVIDIA GPU (no network needed): a 1B-class Llama shape with random weights
in bf16, at 1, 16, 64 and 256 concurrent requests. Per concurrency, plain and instrumented at the
default detail level (``phases``, what the budget is about) in alternating rounds, then one more
pair with the instrumented side at ``steps`` (step spans, the CUDA-event GPU timer on). Prints per
concurrency:

* instrumented / plain output-token throughput at the default level (budget, docs/architecture.md:
  at least 0.995), and at ``steps``;
* the CUDA-event GPU time per step next to the wall time per step (GPU time never above wall
  time, and close to it when the step is GPU-bound);
* the hook cost per step on the engine's thread (microseconds);
* the traced requests: every request of the timed traced runs has its ``llm.request`` span, with
  the output tokens the engine gave it;
* then, at the largest concurrency, one run delivered as a user's process delivers (a span
  process writing a trace file, ``steps`` detail): every request and step in the file, and on
  CUDA every step with its GPU time, never above its wall time.

Without CUDA (``--device cpu``, or auto on a machine without one) it runs the same code on the
project's tiny model in fp32 at small concurrency: what CI checks, so the script keeps working.

Run: ``python benchmarks/gpu_check.py`` (``make gpu-check``; on a GPU machine without network,
``make gpu-wheels`` here first and carry ``.whl/``: the target then runs with that machine's
python3, torch and transformers). Options: ``--device auto|cpu|cuda``, ``--concurrency
1,16,64,256``, ``--rounds 3``, ``--tokens 64``, ``--prompt 128``, ``--json FILE``. About four
minutes on an H200 with the defaults.
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


BUDGET = 0.995  # docs/architecture.md, "The hot path": at least 99.5% of plain throughput on a GPU


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

    from otel_llm import environment

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
    traced = cb_runs.tracing(device, environment.DEFAULT_DETAIL)
    sync = torch.cuda.synchronize if gpu else None
    vocab = model.config.vocab_size
    steps_traced = cb_runs.tracing(device, "steps")
    results = []
    for n in conc:
        batch = cb_runs.prompts(n, plen, vocab)
        gen, cb = cb_runs.configs(tokens, n, plen)
        r = cb_runs.alternate(model, traced, batch, gen, cb, a.rounds, sync)
        st = cb_runs.alternate(model, steps_traced, batch, gen, cb, 1, sync)
        try:  # on the real request classes: a transformers version that builds them otherwise says so
            hook = cb_runs.hook_cost_us(n)
        except Exception as exc:
            print(f"hook cost: not measured ({type(exc).__name__}: {exc})", flush=True)
            hook = float("nan")
        wall = statistics.median(st.step_wall_ms) if st.step_wall_ms else float("nan")
        g = statistics.median(st.step_gpu_ms) if st.step_gpu_ms else None
        over = sum(1 for gg, w in zip(st.step_gpu_ms, st.step_wall_ms) if gg > w * 1.001)
        row = {
            "concurrency": n,
            "detail": traced[0].pipeline.detail,
            "plain_tok_s": statistics.median(r.plain),
            "instrumented_tok_s": statistics.median(r.traced),
            "ratio_median": statistics.median(r.ratios),
            "ratio_rounds": r.ratios,
            "ratio_all_rounds": r.ratio_all,
            "steps_ratio": st.ratios[0],
            "requests_traced": r.requests + st.requests,
            "requests_run": (a.rounds + 1) * n,
            "tokens_traced": r.request_tokens + st.request_tokens,
            "tokens_run": r.expected_tokens + st.expected_tokens,
            "steps": st.steps,
            "step_wall_ms_median": wall,
            "step_gpu_ms_median": g,
            "steps_gpu_above_wall": over if g is not None else None,
            "hook_us_per_step": hook,
        }
        results.append(row)
        gtxt = f"GPU {g:.2f} ms/step (steps with GPU > wall: {over})" if g is not None else "GPU time: n/a (no CUDA)"
        print(
            f"concurrency {n:>4}: plain {row['plain_tok_s']:,.0f} tok/s, instrumented ({row['detail']}) "
            f"{row['instrumented_tok_s']:,.0f} tok/s, ratio {row['ratio_median']:.3f} (rounds "
            f"{', '.join(f'{x:.3f}' for x in r.ratios)}; all rounds {r.ratio_all:.3f}); at steps "
            f"{row['steps_ratio']:.3f}; wall {wall:.2f} ms/step, {gtxt}; hook {hook:.1f} us/step; traced "
            f"{row['requests_traced']}/{row['requests_run']} requests, {row['tokens_traced']:,}/{row['tokens_run']:,} "
            "tokens",
            flush=True,
        )
    # the delivery a user's process gets: a span process writing the trace file, steps GPU-timed
    n = conc[-1]
    gen, cb = cb_runs.configs(tokens, n, plen)
    sp = cb_runs.through_span_process(
        model, device, cb_runs.prompts(n, plen, vocab), gen, cb, os.path.join(tempfile.mkdtemp(), "t.jsonl")
    )
    print(
        f"span process ({n} requests, steps detail, trace file): {sp['requests']}/{n} requests, "
        f"{sp['tokens']:,}/{sp['tokens_run']:,} tokens, {sp['steps']} step spans, {sp['steps_gpu_timed']} with a GPU "
        f"time ({sp['steps_gpu_above_wall']} above their wall time); span process CPU {sp['span_process_cpu_s']:.2f} s",
        flush=True,
    )
    print(
        f"budget: instrumented/plain >= {BUDGET} at every concurrency at the default level; "
        f"took {time.perf_counter() - t_start:.0f} s"
    )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(
                {
                    "device": name,
                    "model": what,
                    "tokens": tokens,
                    "prompt": plen,
                    "results": results,
                    "span_process": sp,
                },
                fh,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
