"""transformers continuous batching runs, plain and instrumented, for the benchmarks that measure
it (benchmarks/gpu_check.py, benchmarks/overhead.py --engine transformers).

A run is one ``generate_batch`` of ``n`` random prompts with ``ignore_eos``-style fixed output
lengths (``eos_token_id=-1``); its output-token throughput is tokens / wall seconds. The traced
model's spans go to an in-memory exporter, read back per run for the step times (wall and, on
CUDA, GPU) and dropped.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

#: A 1B-class Llama shape (Llama 3.2 1B), random weights: what the GPU check runs.
LLAMA_1B = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=4096,
)


def build_model(shape: dict | None, device: str, dtype_name: str, tiny_dir: str | None = None):
    """A random-weight Llama (``shape``; None: the project's tiny model from ``tiny_dir``) on
    ``device``, with paged attention for continuous batching."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, dtype_name)
    if shape is None:
        from engine_hooks.tiny_model import build_tiny_model

        model = AutoModelForCausalLM.from_pretrained(
            build_tiny_model(tiny_dir), attn_implementation="paged|eager", dtype=dtype
        )
    else:
        torch.manual_seed(0)
        cfg = LlamaConfig(**shape, torch_dtype=dtype)
        cfg._attn_implementation = "paged|eager" if device == "cpu" else "paged|sdpa"
        with torch.device(device):
            model = LlamaForCausalLM(cfg).to(dtype)
    return model.to(device).eval()


def configs(tokens: int, n: int, prompt_len: int, page: int = 16):
    """Generation and cache settings pinned (sizing the cache from memory takes long on the CPU):
    room for every request at once."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1)
    blocks = n * (-(-(prompt_len + tokens) // page) + 1) + 8
    # the page's name: page_size from transformers 5.19, block_size before (5.17: the lent GPU's)
    fields = getattr(ContinuousBatchingConfig, "__dataclass_fields__", {})
    page_field = "block_size" if "block_size" in fields and "page_size" not in fields else "page_size"
    cb = ContinuousBatchingConfig(
        num_blocks=blocks,
        max_batch_tokens=max(256, min(8192, n * prompt_len)),
        max_requests_per_batch=n,
        **{page_field: page},
    )
    return gen, cb


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % (vocab - 4) + 4 for j in range(length)] for i in range(n)]


@dataclass
class Rounds:
    """Output tokens/s of each round, plain and instrumented; the traced rounds' steps (when their
    detail level sends step spans) and requests (what the spans say, to check against the batch)."""

    plain: list[float] = field(default_factory=list)
    traced: list[float] = field(default_factory=list)
    step_wall_ms: list[float] = field(default_factory=list)
    step_gpu_ms: list[float] = field(default_factory=list)
    steps: int = 0
    requests: int = 0  # llm.request spans of the timed traced runs
    request_tokens: int = 0  # the output tokens they say
    expected_tokens: int = 0  # what the timed traced runs generated

    @property
    def ratios(self) -> list[float]:
        return [t / p for t, p in zip(self.traced, self.plain)]

    @property
    def ratio_all(self) -> float:
        """Total tokens / total time of each (the harmonic mean of its rates), traced over plain."""
        h = lambda v: len(v) / sum(1 / x for x in v)
        return h(self.traced) / h(self.plain)


class Served:
    """A started ContinuousBatchingManager of one model (as a server holds it): runs are timed
    from the first request added to the last result, without the manager's start and stop."""

    def __init__(self, model, gen, cb, hooks=None):
        self.manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        if hooks is not None:  # the traced side: this manager only, the same model and weights
            from engine_hooks.transformers import instrument_manager

            instrument_manager(self.manager, hooks)
        self.manager.start()
        self.tokens = 0  # output tokens of the last run

    def run(self, batch: list[list[int]], max_new_tokens: int | None = None) -> float:
        """Output tokens/s of one batch (``max_new_tokens``: fewer than the manager's, a warm-up)."""
        m = self.manager
        t0 = time.perf_counter()
        ids = set(m.add_requests(batch, max_new_tokens=max_new_tokens) if max_new_tokens else m.add_requests(batch))
        tokens = 0
        while ids:
            out = m.get_result(timeout=60)
            if out is None:
                raise RuntimeError("continuous batching stopped before the batch finished")
            if out.request_id in ids and out.is_finished():
                ids.discard(out.request_id)
                tokens += len(out.generated_tokens)
        self.tokens = tokens
        return tokens / (time.perf_counter() - t0)

    def stop(self) -> None:
        self.manager.stop(block=True, timeout=30)
        self.manager.destroy()


WARMUP_TOKENS = 4  # each manager's warm-up: 4 requests of this many tokens before its timed run


def alternate(model, tracing, batch, gen, cb, rounds: int, sync=None) -> Rounds:
    """``rounds`` rounds, plain and instrumented alternating who goes first. Each run gets a
    manager of its own (started, warmed up on 4 short requests, then timed): two managers alive
    side by side ran at different speeds here whatever they traced (the one started first 20-30%
    faster, for identical untraced models), so none outlives its run."""
    from otel_llm import semconv as sc

    hooks, mem = tracing
    pipeline = hooks.pipeline
    r = Rounds()
    sides = [("plain", None), ("traced", hooks)]
    for i in range(rounds):
        for name, h in sides if i % 2 == 0 else sides[::-1]:
            served = Served(model, gen, cb, h)
            try:
                served.run(batch[: min(len(batch), 4)], WARMUP_TOKENS)
                if h is not None:
                    pipeline.flush()
                    mem.clear()
                if sync:
                    sync()
                getattr(r, name).append(served.run(batch))
                if h is not None:
                    r.expected_tokens += served.tokens
            finally:
                served.stop()
        for _ in range(40):  # GPU times are read back once their events completed
            pipeline.flush()
            if not pipeline.tracker.pending_gpu:
                break
            time.sleep(0.05)
        for s in mem.get_finished_spans():
            if s.name == sc.SPAN_STEP:
                r.steps += 1
                r.step_wall_ms.append((s.end_time - s.start_time) / 1e6)
                g = s.attributes.get(sc.STEP_GPU_TIME_NS)
                if g is not None:
                    r.step_gpu_ms.append(g / 1e6)
            elif s.name == sc.SPAN_REQUEST:
                r.requests += 1
                r.request_tokens += int(s.attributes.get(sc.OUTPUT_TOKENS, 0))
        mem.clear()
    return r


def tracing(device: str, detail: str | None = None):
    """The traced side's hooks (a pipeline of its own at ``detail``, default ``OTEL_LLM_DETAIL``,
    whose spans stay in memory; the GPU timer on CUDA, which runs where step spans are sent) and
    its exporter."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from engine_hooks import CudaEventTimer, EngineHooks, TracingPipeline

    mem = InMemorySpanExporter()
    pipeline = TracingPipeline(mem, service_name="transformers", detail=detail)
    timer = CudaEventTimer.if_available() if device == "cuda" else None
    return EngineHooks(pipeline, engine="transformers", gpu_timer=timer), mem


def hook_cost_us(batch: int, n: int = 2000) -> float:
    """The adapter's hot-path work per step at ``batch`` requests, in microseconds: the schedule
    hook over the batch's FutureRequestStates, the step's raw reference and the step record, on
    the real transformers request classes (no model)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from transformers.generation.continuous_batching.requests import FutureRequestState, RequestState

    from engine_hooks import EngineHooks, TracingPipeline
    from engine_hooks.transformers import _Loop, _tokens_of_step

    hooks = EngineHooks(TracingPipeline(InMemorySpanExporter()))
    loop = _Loop()
    states = [RequestState(request_id=f"r{i}", initial_tokens=[1, 2, 3]) for i in range(batch)]
    for s in states:
        s.generated_tokens = [5]
    fs = [FutureRequestState(s, True, {}, 1) for s in states]
    result = (fs, True, batch, 64)
    sched = hooks.schedule(scheduled=lambda res: loop.scheduled(res))(lambda: result)
    raw = hooks.raw(payload=lambda res: res[0], expander=_tokens_of_step)(lambda: result)
    step = hooks.step(
        batch_size=lambda res: loop.batch,
        prefill_tokens=lambda res: loop.prefill,
        decode_tokens=lambda res: loop.decode,
    )(lambda: None)
    costs = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            sched()
            raw()
            step()
        costs.append((time.perf_counter_ns() - t0) / n / 1e3)
        hooks.pipeline.recorder.drain()
    return statistics.median(costs)


def through_span_process(model, device: str, batch, gen, cb, traces: str) -> dict:
    """One traced run as a user's process makes it: the default delivery (a span process, writing
    the trace file ``traces``) at ``steps``, the GPU timer on CUDA. Returns what the trace file
    holds: requests and their output tokens, steps and those with a GPU time (never above the
    step's wall time)."""
    import os

    from engine_hooks import CudaEventTimer, EngineHooks, TracingPipeline
    from otel_llm import semconv as sc
    from otel_llm.otlp.span_records import read_trace_file

    saved = os.environ.get("OTEL_LLM_TRACES_FILE")
    os.environ["OTEL_LLM_TRACES_FILE"] = traces  # what the span process exports to
    try:
        pipeline = TracingPipeline(None, service_name="transformers", detail="steps", span_process=True).start()
    finally:
        if saved is None:
            os.environ.pop("OTEL_LLM_TRACES_FILE")
        else:
            os.environ["OTEL_LLM_TRACES_FILE"] = saved
    timer = CudaEventTimer.if_available() if device == "cuda" else None
    served = Served(model, gen, cb, EngineHooks(pipeline, engine="transformers", gpu_timer=timer))
    try:
        served.run(batch)
        tokens = served.tokens
    finally:
        served.stop()
    pipeline.shutdown()
    spans = read_trace_file(traces)
    steps = [s for s in spans if s.name == sc.SPAN_STEP]
    timed = [s for s in steps if sc.STEP_GPU_TIME_NS in s.attributes]
    return {
        "requests": sum(1 for s in spans if s.name == sc.SPAN_REQUEST),
        "tokens": sum(int(s.attributes.get(sc.OUTPUT_TOKENS, 0)) for s in spans if s.name == sc.SPAN_REQUEST),
        "tokens_run": tokens,
        "steps": len(steps),
        "steps_gpu_timed": len(timed),
        "steps_gpu_above_wall": sum(
            1 for s in timed if s.attributes[sc.STEP_GPU_TIME_NS] > (s.end_ns - s.start_ns) * 1.001
        ),
        "span_process_cpu_s": pipeline.counters.span_process_cpu_ns / 1e9,
    }
