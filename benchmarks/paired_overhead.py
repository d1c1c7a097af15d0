"""Benchmark: what tracing costs vLLM, two engines at a time, each on a core of its own.

``overhead.py`` runs its engines one after another, so each sees the machine as it was during its
own batch; on a shared VM whose speed swings by tens of percent from one minute to the next, its
rounds cannot resolve 1%. Here two engines run the same batch at the same moment, each pinned
(with every process under it: front end, engine core, worker) to one of two cores, so what slows
the machine slows both. Six engines: plain, instrumented (``engine_hooks.instrument``, at
``--detail``, exporting over OTLP/gRPC to a local sink or with ``--exporter file`` to
``OTEL_LLM_TRACES_FILE``) and vLLM's own tracing (``otlp_traces_endpoint``, to the same sink), one of
each on each core. Each round runs five pairs:

* plain on core 0 against plain on core 1: the noise floor (how far two identical engines drift
  apart in one pair), and the two cores' speed ratio;
* instrumented against plain, once on each side of the cores; and vLLM's tracing against plain, the
  same. A round's ratio is the geometric mean of its two pairs, which cancels the cores' own speed
  difference (``(i c1 / p c0) (i c0 / p c1) = (i / p)^2``).

Prints, per round and as medians with a 95% bootstrap interval: output-token throughput ratios to
plain (1 = free), the CPU per output token ratios (plain / traced, the CPU of each engine's
process tree over its batch), and ours against vLLM's own tracing, round by round. One core per
engine is the worst case for tracing: all of its work, span thread included, comes out of the
engine's own core, where on a larger machine it would find a core the engine is not using.

Run: ``.venv/bin/python benchmarks/paired_overhead.py [--rounds 8] [--requests 64] [--tokens 128]
[--detail request|phases|steps] [--exporter otlp|file]``
Target (docs/architecture.md, "The hot path"): instrumented/plain >= 0.99, and no worse than vLLM's
own tracing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# engines that wait must not spin their OpenMP threads on the core another engine is using
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KMP_BLOCKTIME", "0")

from overhead import Sink, export_env, make_engine, median_interval, tree_cpu_s  # noqa: E402

KINDS = ("plain", "instrumented", "vllm-tracing")


def worker(a: argparse.Namespace) -> None:
    """``--worker KIND --core N``: one engine pinned to core N; runs the batch on each ``run`` line
    of stdin and writes one JSON line (output tokens, seconds, CPU seconds of its process tree) to
    the file descriptor ``--reply``."""
    os.sched_setaffinity(0, {a.core})  # inherited by the engine core and worker processes it starts
    reply = os.fdopen(a.reply, "w", buffering=1)
    if a.worker != "instrumented":
        for k in ("OTEL_LLM_TRACES_FILE", "OTEL_LLM_DETAIL"):
            os.environ.pop(k, None)
    elif os.environ.get("OTEL_LLM_TRACES_FILE"):  # a file of its own
        os.environ["OTEL_LLM_TRACES_FILE"] += f".core{a.core}"
    from vllm import SamplingParams

    import engine_hooks
    from engine_hooks.tiny_model import prompt

    llm = make_engine(a.worker, a.model, a.kv_mib)
    prompts = [prompt(32, seed=i) for i in range(a.requests)]
    sp = SamplingParams(max_tokens=a.tokens, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)  # warm-up
    reply.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if line.strip() != "run":
            break
        c0 = tree_cpu_s()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        engine_hooks.flush()  # the instrumented engine's last spans, in its own batch's CPU
        cpu = tree_cpu_s() - c0
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        reply.write(json.dumps({"tokens": toks, "seconds": dt, "cpu": cpu}) + "\n")


class Engine:
    """A :func:`worker` process and the pipe it answers on."""

    def __init__(self, kind: str, core: int, a: argparse.Namespace, model: str, log_dir: str):
        self.kind, self.core = kind, core
        r, w = os.pipe()
        argv = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--core", str(core), "--reply", str(w)]
        argv += ["--model", model, "--requests", str(a.requests), "--tokens", str(a.tokens), "--kv-mib", str(a.kv_mib)]
        self.log = open(os.path.join(log_dir, f"{kind}-{core}.log"), "w")  # noqa: SIM115 (held by the worker)
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, text=True, pass_fds=(w,)
        )
        os.close(w)
        self.replies = os.fdopen(r)

    def answer(self) -> dict:
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"the {self.kind} engine on core {self.core} exited; see {self.log.name}")
        return json.loads(line)

    def start(self) -> None:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def pair(x: Engine, y: Engine) -> tuple[dict, dict]:
    """Both engines run the batch at the same moment."""
    x.start()
    y.start()
    return x.answer(), y.answer()


def geo(a: float, b: float) -> float:
    return math.sqrt(a * b)


def summary(name: str, values: list[float], note: str = "") -> str:
    lo, hi = median_interval(values)
    rounds = ", ".join(f"{v:.3f}" for v in values)
    return f"{name}: median {statistics.median(values):.3f}, 95% interval {lo:.3f}-{hi:.3f} (rounds: {rounds}){note}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--model", default=None, help="model folder (default: build the tiny model in a temp dir)")
    ap.add_argument("--detail", choices=("request", "phases", "steps"), default="phases")
    ap.add_argument(
        "--exporter",
        choices=("otlp", "file"),
        default="otlp",
        help="the instrumented engines' exporter: OTLP/gRPC to a local sink (default), or OTEL_LLM_TRACES_FILE",
    )
    ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--core", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--reply", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("paired_overhead.py needs two cores (it pins one engine to each)")
    c0, c1 = cores[:2]

    from engine_hooks.tiny_model import build_tiny_model

    tmp = tempfile.mkdtemp(prefix="otel-llm-paired-")
    model = a.model or build_tiny_model(os.path.join(tmp, "tiny"))
    sink = Sink()
    os.environ["OTEL_LLM_DETAIL"] = a.detail
    export_env(sink.port, a.exporter, tmp)  # with file, each instrumented worker gets a file of its own
    print(f"starting 6 engines (tiny model, {a.kv_mib} MiB KV cache), 3 pinned to core {c0} and 3 to core {c1}...")
    engines = {(k, c): Engine(k, c, a, model, tmp) for k in KINDS for c in (c0, c1)}
    try:
        for e in engines.values():
            e.answer()  # ready
        run(a, engines, c0, c1, sink)
    finally:
        for e in engines.values():
            e.stop()


def run(a: argparse.Namespace, engines: dict, c0: int, c1: int, sink: Sink) -> None:
    e = lambda kind, core: engines[(kind, core)]
    rate = lambda r: r["tokens"] / r["seconds"]
    cpu = lambda r: r["cpu"] / r["tokens"]  # CPU s per output token
    floor = []  # plain on core 0 / plain on core 1
    ratio = {k: [] for k in KINDS[1:]}  # traced / plain throughput, geometric mean of the two sides
    cpu_ratio = {k: [] for k in KINDS[1:]}  # plain / traced CPU per output token, the same
    rates: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(a.rounds):
        p0, p1 = pair(e("plain", c0), e("plain", c1))
        floor.append(rate(p0) / rate(p1))
        rates["plain"] += [rate(p0), rate(p1)]
        for kind in KINDS[1:]:
            # the two sides in turn, the order rotating from round to round
            sides = [(e(kind, c0), e("plain", c1)), (e(kind, c1), e("plain", c0))]
            if r % 2:
                sides.reverse()
            got = [pair(t, p) for t, p in sides]
            ratio[kind].append(geo(*(rate(t) / rate(p) for t, p in got)))
            cpu_ratio[kind].append(geo(*(cpu(p) / cpu(t) for t, p in got)))
            rates[kind] += [rate(t) for t, _ in got]
        print(
            f"round {r + 1}/{a.rounds}: plain/plain {floor[-1]:.3f}, "
            + ", ".join(f"{k} / plain {v[-1]:.3f} (CPU {cpu_ratio[k][-1]:.3f})" for k, v in ratio.items()),
            flush=True,
        )
    ours_vs_vllm = [o / v for o, v in zip(ratio["instrumented"], ratio["vllm-tracing"])]
    print()
    print(
        f"{a.requests} requests x {a.tokens} tokens per batch, {a.rounds} rounds, detail {a.detail}, "
        f"exporter {a.exporter}, one engine per core"
    )
    for k, v in rates.items():
        print(f"{k:>13}: median {statistics.median(v):,.0f} output tok/s per core")
    spread = statistics.median(abs(math.log(x / statistics.median(floor))) for x in floor)
    print(
        summary("noise floor, plain on one core / plain on the other", floor)
        + f"; its median deviation {math.expm1(spread) * 100:.2f}%"
    )
    print(summary("instrumented / plain", ratio["instrumented"], "  target >= 0.99"))
    print(summary("vllm-tracing / plain", ratio["vllm-tracing"]))
    print(summary("instrumented / vllm-tracing", ours_vs_vllm, "  target >= 1 (no worse than vLLM's own)"))
    print(summary("CPU per output token, plain / instrumented", cpu_ratio["instrumented"]))
    print(summary("CPU per output token, plain / vllm-tracing", cpu_ratio["vllm-tracing"]))
    spans, _ = sink.report()
    print(f"the sink received {spans} spans")
    result = {
        "detail": a.detail,
        "exporter": a.exporter,
        "floor_rounds": floor,
        "ratio_rounds": ratio["instrumented"],
        "ratio_median": statistics.median(ratio["instrumented"]),
        "vllm_tracing_rounds": ratio["vllm-tracing"],
        "ours_vs_vllm_rounds": ours_vs_vllm,
        "cpu_ratio_rounds": cpu_ratio["instrumented"],
        "vllm_tracing_cpu_ratio_rounds": cpu_ratio["vllm-tracing"],
        "rounds_at_or_above_0.99": sum(x >= 0.99 for x in ratio["instrumented"]),
        "rounds_no_worse_than_vllm": sum(x >= 1 for x in ours_vs_vllm),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
