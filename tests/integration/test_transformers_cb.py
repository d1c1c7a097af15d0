"""transformers continuous batching traced with one call (engine_hooks.instrument), on the CPU
with the tiny random Llama: spans checked against the engine's own per-request state (its
generated tokens, its per-token timestamps and lifespan, its own log of offloaded requests), the
outputs unchanged by tracing, streaming, cancellation, and the collector deriving the records the
way it derives vLLM's."""

from __future__ import annotations

import logging
import re

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine_hooks import EngineHooks, TracingPipeline
from otel_llm import semconv as sc

PAGE, MAX_NEW = 16, 16
PROMPTS = [[5 + i] * (20 + 10 * i) for i in range(8)]  # 20..90 prompt tokens


@pytest.fixture(scope="module")
def load(tiny_model):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    def fresh():
        return AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="paged|eager", dtype=torch.float32)

    return fresh


def configs(num_blocks=64):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=-1)
    # pinned sizes: sizing the cache from the machine's memory takes tens of seconds on the CPU
    return gen, ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=256, page_size=PAGE)


def traced(model):
    """The model instrumented into a pipeline of its own, strict (a failing hook raises)."""
    from engine_hooks.transformers import instrument

    mem = InMemorySpanExporter()
    pipeline = TracingPipeline(mem, service_name="transformers")
    instrument(model, EngineHooks(pipeline, engine="transformers", strict=True))
    return mem, pipeline


def tree(mem) -> tuple[dict, list]:
    """({request id: {span name: [spans]}}, step spans)."""
    spans = mem.get_finished_spans()
    roots = {s.context.span_id: s for s in spans if s.name == sc.SPAN_REQUEST}
    out = {r.attributes[sc.REQUEST_ID]: {sc.SPAN_REQUEST: [r]} for r in roots.values()}
    for s in spans:
        if s.parent is not None and s.parent.span_id in roots:
            out[roots[s.parent.span_id].attributes[sc.REQUEST_ID]].setdefault(s.name, []).append(s)
    return out, [s for s in spans if s.name == sc.SPAN_STEP]


def test_generate_batch_spans_match_the_engines_own_state(load):
    from otel_llm.clock import WallAnchor

    model = load()
    mem, pipeline = traced(model)
    gen, cb = configs()
    out = model.generate_batch(
        inputs=PROMPTS, generation_config=gen, continuous_batching_config=cb, record_timestamps=True
    )
    pipeline.process(final=True)
    assert pipeline.counters.hook_errors == 0
    reqs, steps = tree(mem)
    assert set(reqs) == set(out) and len(out) == 8
    anchor = WallAnchor()
    wall = lambda perf_s: anchor.wall_ns_from_mono_s(perf_s)  # perf_counter is this host's monotonic clock
    for rid, o in out.items():
        got = reqs[rid]
        req = got[sc.SPAN_REQUEST][0]
        a = req.attributes
        assert {sc.SPAN_FRONTEND, sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE, sc.SPAN_STREAM} <= set(got), rid
        assert a[sc.STATUS] == "ok" and list(a[sc.FINISH_REASONS]) == ["length"]
        assert a[sc.OUTPUT_TOKENS] == len(o.generated_tokens) == MAX_NEW
        assert a[sc.INPUT_TOKENS] == len(PROMPTS[int(rid.split("_")[1])])
        # each token event is the step that sampled the token: just before the engine stamped it
        ours = [req.start_time + x for x in a[sc.TOKEN_EVENT_OFFSETS]]
        theirs = [wall(t) for t in o.timestamps]
        assert len(ours) == len(theirs) == MAX_NEW
        assert all(-1_000_000 < t - u < 20_000_000 for u, t in zip(ours, theirs)), [t - u for u, t in zip(ours, theirs)]
        # the engine's lifespan: scheduled (no longer pending) -> finished, inside ours
        first_sched = got[sc.SPAN_QUEUE][0].end_time
        assert abs(first_sched - wall(o.lifespan[0])) < 20_000_000
        assert req.start_time <= wall(o.created_time) + 1_000_000 and req.end_time >= wall(o.lifespan[1]) - 1_000_000
        assert got[sc.SPAN_PREFILL][0].end_time == ours[0]
    # steps: every prompt token prefilled once, every later token decoded once
    assert sum(s.attributes[sc.STEP_PREFILL_TOKENS] for s in steps) == sum(map(len, PROMPTS))
    assert sum(s.attributes[sc.STEP_DECODE_TOKENS] for s in steps) == 8 * (MAX_NEW - 1)
    assert all(1 <= s.attributes[sc.STEP_BATCH_SIZE] <= 8 and 0 <= s.attributes[sc.STEP_KV_USAGE] <= 1 for s in steps)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_preemptions_are_the_engines_own_offloads_and_outputs_do_not_change(load):
    """A cache of 10 blocks for 8 requests: the offloading manager evicts (soft reset). Each
    eviction it logs is one llm.preemption; the tokens are those of the same run untraced."""
    gen, cb = configs(num_blocks=10)
    plain = load().generate_batch(inputs=PROMPTS, generation_config=gen, continuous_batching_config=configs(10)[1])
    model = load()
    mem, pipeline = traced(model)
    log, lines = logging.getLogger("ContinuousBatchingLogger"), Lines()
    level = log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)  # the engine logs each eviction at INFO
    try:
        out = model.generate_batch(inputs=PROMPTS, generation_config=gen, continuous_batching_config=cb)
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    pipeline.process(final=True)
    offloaded = sum(int(m.group(1)) for m in re.finditer(r"Offloaded (\d+) requests", "\n".join(lines.lines)))
    reqs, _ = tree(mem)
    preemptions = [p for got in reqs.values() for p in got.get(sc.SPAN_PREEMPTION, [])]
    assert offloaded > 0 and len(preemptions) == offloaded
    assert {p.attributes[sc.PREEMPTION_MODE] for p in preemptions} == {"recompute"}  # no CPU swap space given
    assert sum(r[sc.SPAN_REQUEST][0].attributes[sc.PREEMPTIONS] for r in reqs.values()) == offloaded
    assert {k: list(v.generated_tokens) for k, v in out.items()} == {
        k: list(v.generated_tokens) for k, v in plain.items()
    }
    assert all(r[sc.SPAN_REQUEST][0].attributes[sc.OUTPUT_TOKENS] == MAX_NEW for r in reqs.values())


def test_streaming_and_cancellation_through_the_manager(load):
    import time

    model = load()
    mem, pipeline = traced(model)
    gen, cb = configs()
    gen.max_new_tokens = 64
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        streamed = manager.add_request(PROMPTS[0], streaming=True, max_new_tokens=12)
        doomed = manager.add_request(PROMPTS[1], max_new_tokens=64)
        chunks = list(manager.request_id_iter(streamed))
        manager.cancel_request(doomed)
        time.sleep(0.5)
    finally:
        manager.stop(block=True, timeout=10)
    pipeline.process(final=True)
    reqs, _ = tree(mem)
    s = reqs[streamed][sc.SPAN_REQUEST][0].attributes
    assert s[sc.STATUS] == "ok" and s[sc.OUTPUT_TOKENS] == 12 == len(chunks[-1].generated_tokens)
    assert streamed == "req_0" and doomed == "req_1"  # the ids the manager would have given untraced
    d = reqs[doomed][sc.SPAN_REQUEST][0].attributes
    assert d[sc.STATUS] == "cancelled" and 0 < d[sc.OUTPUT_TOKENS] < 64


def test_the_collector_derives_transformers_records_as_vllms(load, tmp_path):
    """The same derivation: a traces file of a generate_batch run, read back by otel-llm analyze
    at the engine boundary, gives the engine's own token counts."""
    import json

    from conftest import run_cli

    from otel_llm.otlp.export import FileSpanExporter

    model = load()
    path = tmp_path / "t.jsonl"
    pipeline = TracingPipeline(FileSpanExporter(str(path)), service_name="transformers")
    from engine_hooks.transformers import instrument

    instrument(model, EngineHooks(pipeline, engine="transformers", strict=True))
    gen, cb = configs()
    out = model.generate_batch(inputs=PROMPTS, generation_config=gen, continuous_batching_config=cb)
    pipeline.shutdown()
    got = json.loads(run_cli("analyze", "--traces", path, "--boundary", "engine", "--format", "json").stdout)
    assert got["counts"]["requests"] == 8 == got["counts"]["completed"]
    assert got["throughput"]["output_tokens"] == sum(len(o.generated_tokens) for o in out.values())
    assert got["counts"]["multi_token_events"] == 0  # one token per event: ITL is exact


def test_one_call_on_the_model_or_the_manager(load):
    """engine_hooks.instrument takes either, in place, once; other models stay untouched."""
    import engine_hooks
    from engine_hooks.api import hooked

    model, other = load(), load()
    assert engine_hooks.instrument(model) is model and hooked(model.init_continuous_batching)
    assert engine_hooks.instrument(model) is model  # a second call changes nothing
    gen, cb = configs()
    manager = other.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    assert not hooked(other.init_continuous_batching) and not hooked(manager.add_request)
    assert engine_hooks.instrument(manager) is manager and hooked(manager.add_request)
