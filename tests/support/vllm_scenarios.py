"""Real vLLM runs for the engine-hook tests, one scenario per process (vLLM's engine core is a
spawned child, so each run needs ``if __name__ == "__main__"``). Writes the ground truth vLLM
itself reports to OUT (JSON); spans go to ``OTEL_LLM_TRACES_FILE``.

    python tests/support/vllm_scenarios.py SCENARIO MODEL_DIR OUT.json
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

ENGINE_ARGS = dict(dtype="bfloat16", enforce_eager=True, max_model_len=512)
MiB = 2**20


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def prompts(n: int, length: int = 40) -> list[str]:
    from engine_hooks.tiny_model import prompt

    return [prompt(length, seed=i) for i in range(n)]


def truth_of(outputs) -> list[dict]:
    return [
        {
            "id": o.request_id,
            "tokens": len(o.outputs[0].token_ids),
            "preemptions": o.metrics.num_preemptions if o.metrics is not None else None,
            "finish_reason": o.outputs[0].finish_reason,
        }
        for o in outputs
    ]


def scenario_class(model: str, kv_mib: float, n: int, max_tokens: int, stats: bool = False) -> dict:
    """``stats``: the caller asks for vLLM's statistics (``disable_log_stats=False``), whose
    ``RequestOutput.metrics`` are the truth for preemptions."""
    from vllm import LLM, SamplingParams

    import engine_hooks

    TracedLLM = engine_hooks.instrument(LLM)
    asked = {"disable_log_stats": False} if stats else {}
    llm = TracedLLM(model=model, kv_cache_memory_bytes=int(kv_mib * MiB), **asked, **ENGINE_ARGS)
    outs = llm.generate(prompts(n), SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    # the start method vLLM used for its engine core (it overrides the variable when it must spawn)
    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    engine = llm.llm_engine
    return {
        "requests": truth_of(outs),
        "class_name": TracedLLM.__name__,
        "mp_method": method,
        # what the caller sees of vLLM's statistics in the front end
        "front_end_stats": [engine.log_stats, engine.logger_manager is not None, [o.metrics is not None for o in outs]],
    }


#: n-gram speculation (prompt lookup), as docs/engines-here verified on the CPU
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def scenario_speculative(model: str, method: str) -> dict:
    """Speculative decoding (``ngram``, or ``draft`` with the tiny model as its own draft): vLLM's
    own per-request account (``detailed``: every verify step's drafted and accepted tokens) and
    its run counters are the truth. Prompts that repeat a short phrase give n-gram matches."""
    from vllm import LLM, SamplingParams

    import engine_hooks

    draft = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    config = dict(NGRAM) if method == "ngram" else draft
    llm = engine_hooks.instrument(LLM)(
        model=model,
        kv_cache_memory_bytes=64 * MiB,
        disable_log_stats=False,
        speculative_config=config,
        per_request_spec_decode_metrics="detailed",
        **ENGINE_ARGS,
    )
    texts = [" ".join(["w3 w5 w7 w9"] * 10), " ".join(["w2 w4"] * 20), *prompts(4)]
    outs = llm.generate(texts, SamplingParams(max_tokens=48, ignore_eos=True, temperature=0), use_tqdm=False)
    counters = {
        m.name: m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")  # per-position: Vectors
    }
    truth = truth_of(outs)
    for t, o in zip(truth, outs):
        m = o.outputs[0].spec_decode_metrics
        t["drafted"], t["accepted"] = list(m.per_step_drafted), list(m.per_step_accepted)
        t["prompt_tokens"] = len(o.prompt_token_ids)
        t["cached_tokens"] = o.num_cached_tokens or 0
    return {"requests": truth, "counters": counters}


def scenario_prefix(model: str) -> dict:
    """The same 300-token prompt three times, one after another, then with a new one beside it:
    the later ones are served from the prefix cache (whole 128-token blocks, the CPU backend's);
    vLLM says how much in RequestOutput."""
    from vllm import LLM, SamplingParams

    import engine_hooks

    llm = engine_hooks.instrument(LLM)(model=model, kv_cache_memory_bytes=64 * MiB, **ENGINE_ARGS)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    shared, other = prompts(2, length=300)
    outs = []
    for batch in ([shared], [shared], [shared, other]):
        outs += llm.generate(batch, sp, use_tqdm=False)
    return {
        "requests": [
            {"id": o.request_id, "cached": o.num_cached_tokens, "prompt": len(o.prompt_token_ids)} for o in outs
        ]
    }


def scenario_instance(model: str) -> dict:
    from vllm import LLM, SamplingParams

    import engine_hooks

    cap = Captured()
    logging.getLogger("engine_hooks").addHandler(cap)
    llm = LLM(model=model, kv_cache_memory_bytes=64 * MiB, disable_log_stats=False, **ENGINE_ARGS)
    same = engine_hooks.instrument(llm)
    engine_hooks.instrument(llm)  # twice: hooks are never applied twice, the warning comes once
    outs = llm.generate(prompts(16), SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    (two,) = llm.generate(prompts(1), SamplingParams(n=2, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return {
        "requests": truth_of(outs),
        "same_object": same is llm,
        "warnings": cap.messages,
        "n2": {"id": two.request_id, "tokens": [len(c.token_ids) for c in two.outputs]},
    }


async def _async_abort(model: str) -> dict:
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    import engine_hooks

    engine = engine_hooks.instrument(AsyncLLM).from_engine_args(
        AsyncEngineArgs(model=model, kv_cache_memory_bytes=64 * MiB, **ENGINE_ARGS)
    )
    seen: dict[str, int] = {}
    progressed = asyncio.Event()

    async def consume(rid: str, max_tokens: int, traceparent: str | None = None):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        headers = {"traceparent": traceparent} if traceparent else None
        async for out in engine.generate(prompts(1)[0], sp, request_id=rid, trace_headers=headers):
            seen[rid] = len(out.outputs[0].token_ids)
            if rid == "victim" and seen[rid] >= 5:
                progressed.set()

    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    tasks = {
        rid: asyncio.create_task(consume(rid, mt, tp if rid == "ok-0" else None))
        for rid, mt in (("ok-0", 32), ("ok-1", 48), ("victim", 400))
    }
    await asyncio.wait_for(progressed.wait(), 120)
    tasks["victim"].cancel()
    results = await asyncio.gather(*tasks.values(), return_exceptions=True)
    await asyncio.sleep(0.5)
    engine.shutdown()
    return {
        "seen": seen,
        "cancelled": [rid for rid, r in zip(tasks, results) if isinstance(r, asyncio.CancelledError)],
        "traceparent": tp,
    }


def scenario_own_tracing(model: str) -> dict:
    """instrument(vllm.LLM) with vLLM's own tracing on too (otlp_traces_endpoint, to a gRPC
    receiver here): vLLM's llm_request spans, for their gen_ai.latency.time_in_queue."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
    from vllm import LLM, SamplingParams

    import engine_hooks

    got: list = []

    class Rx(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            got.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Rx(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    llm = engine_hooks.instrument(LLM)(
        model=model, kv_cache_memory_bytes=64 * MiB, otlp_traces_endpoint=f"http://127.0.0.1:{port}", **ENGINE_ARGS
    )
    outs = llm.generate(prompts(24), SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    import time

    def theirs():
        out = {}
        for req in got:
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        a = {kv.key: kv.value for kv in sp.attributes}
                        if "gen_ai.latency.time_in_queue" in a:
                            out[a["gen_ai.request.id"].string_value] = a["gen_ai.latency.time_in_queue"].double_value
        return out

    deadline = time.monotonic() + 30  # vLLM's batch span processor exports every 5 s
    while len(theirs()) < len(outs) and time.monotonic() < deadline:
        time.sleep(0.2)
    server.stop(0)
    return {"requests": truth_of(outs), "time_in_queue": theirs()}


def scenario_clock_step(model: str) -> dict:
    """The front end's wall clock steps 40 ms ahead after the engine started (an NTP correction on
    a VM): vLLM stamps arrival with ``time.time()``, the hooks place everything else through the
    anchor taken at start. The engine core's own process keeps the true clock."""
    import time

    from vllm import LLM, SamplingParams

    import engine_hooks

    llm = engine_hooks.instrument(LLM)(model=model, kv_cache_memory_bytes=64 * MiB, **ENGINE_ARGS)
    llm.generate(prompts(1), SamplingParams(max_tokens=4), use_tqdm=False)  # the pipeline and its anchor run
    real_time, real_time_ns = time.time, time.time_ns
    time.time = lambda: real_time() + 0.040
    time.time_ns = lambda: real_time_ns() + 40_000_000
    try:
        outs = llm.generate(prompts(16), SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        time.time, time.time_ns = real_time, real_time_ns
    return {"requests": truth_of(outs)}


def main() -> None:
    scenario, model, out = sys.argv[1], sys.argv[2], sys.argv[3]
    if scenario == "class":
        result = scenario_class(model, kv_mib=64, n=24, max_tokens=32)
    elif scenario == "class-preempt":
        result = scenario_class(model, kv_mib=1, n=32, max_tokens=200, stats=True)
    elif scenario == "prefix":
        result = scenario_prefix(model)
    elif scenario == "instance":
        result = scenario_instance(model)
    elif scenario == "clock-step":
        result = scenario_clock_step(model)
    elif scenario in ("spec-ngram", "spec-draft"):
        result = scenario_speculative(model, scenario.removeprefix("spec-"))
    elif scenario == "own-tracing":
        result = scenario_own_tracing(model)
    elif scenario == "async-abort":
        result = asyncio.run(_async_abort(model))
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
