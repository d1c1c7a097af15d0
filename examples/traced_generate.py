"""Offline vLLM generation traced from the inside with one call: ``instrument(vllm.LLM)``.

    OTEL_LLM_TRACES_FILE=traces.jsonl python examples/traced_generate.py MODEL_DIR

(or set ``OTEL_EXPORTER_OTLP_ENDPOINT`` to send the spans to a collector or Jaeger instead).
A small KV cache forces preemptions, so the trace shows them, and the script prints the count
vLLM's own statistics kept (``vllm:num_preemptions``), to set beside the ``llm.preemption`` spans.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    from vllm import LLM, SamplingParams

    import engine_hooks
    from engine_hooks.tiny_model import prompt

    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} MODEL_DIR [KV_CACHE_MiB]  (python -m engine_hooks.tiny_model out/tiny-llama)")
    model = sys.argv[1]
    kv_mib = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    TracedLLM = engine_hooks.instrument(LLM)  # same constructor, same API, traced
    llm = TracedLLM(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_bytes=int(kv_mib * 2**20),
        disable_log_stats=False,  # vLLM's own statistics in the front end too, for its preemption count below
    )
    outs = llm.generate(
        [prompt(40, seed=i) for i in range(24)], SamplingParams(max_tokens=120, ignore_eos=True), use_tqdm=False
    )
    pre = sum(int(getattr(m, "value", 0)) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    print(
        f"generated {sum(len(o.outputs[0].token_ids) for o in outs)} tokens for {len(outs)} requests; "
        f"vLLM's statistics counted {pre} preemptions (vllm:num_preemptions; the trace has an llm.preemption "
        "span for each)"
    )


if __name__ == "__main__":
    main()
