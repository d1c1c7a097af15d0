"""engine_hooks on real vLLM (CPU, tiny random-weight model): spans checked against vLLM's own
per-request truth."""

from collections import Counter

import pytest
from conftest import run_vllm_scenario
from support.spantree import check_nesting_and_order, request_trees

from otel_llm import semconv as sc

# each scenario in a process of its own, checked against vLLM's own account: no timing measured
pytestmark = [pytest.mark.slow, pytest.mark.parallel_safe]


def test_class_form_with_preemptions(tmp_path, tiny_model):
    """instrument(vllm.LLM) with a 1 MiB KV cache: every request's llm.preemption spans match
    vLLM's RequestOutput.metrics.num_preemptions, and token counts match its outputs."""
    truth, spans = run_vllm_scenario(tmp_path, "class-preempt", tiny_model)
    assert truth["class_name"] == "LLM"
    # the caller asked for vLLM's statistics (disable_log_stats=False): its front end keeps them
    assert truth["front_end_stats"] == [True, True, [True] * 32]
    trees = request_trees(spans)
    reqs = {r["id"]: r for r in truth["requests"]}
    assert set(trees) == set(reqs)
    total_preemptions = 0
    for rid, tree in trees.items():
        check_nesting_and_order(tree)
        root = tree["root"]
        assert root.attributes[sc.STATUS] == "ok"
        assert root.attributes[sc.OUTPUT_TOKENS] == reqs[rid]["tokens"] == 200
        assert root.attributes[sc.INPUT_TOKENS] == 40
        pre = tree["children"].get(sc.SPAN_PREEMPTION, [])
        assert len(pre) == reqs[rid]["preemptions"] == root.attributes[sc.PREEMPTIONS]
        assert all(p.attributes[sc.PREEMPTION_MODE] == "recompute" for p in pre)
        total_preemptions += len(pre)
        for name in (sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE, sc.SPAN_STREAM):
            assert len(tree["children"][name]) == 1, name
        # preemptions happen between the first token and the last
        for p in pre:
            assert p.start_ns >= tree["children"][sc.SPAN_PREFILL][0].start_ns
    assert total_preemptions > 0, "a 1 MiB KV cache should force preemptions"
    # the engine core's account of each preemption, taken as it decided: its KV cache's usage then and
    # the request's computed tokens (vLLM's num_computed_tokens), one llm.engine.preemption span each,
    # named by the internal id the front end's request span carries
    internal = {t["root"].attributes[sc.REQUEST_INTERNAL_ID]: t for t in trees.values()}
    core = [s for s in spans if s.name == sc.SPAN_ENGINE_PREEMPTION]
    assert len(core) == total_preemptions
    assert Counter(s.attributes[sc.REQUEST_INTERNAL_ID] for s in core) == Counter(
        {
            i: len(t["children"].get(sc.SPAN_PREEMPTION, []))
            for i, t in internal.items()
            if t["children"].get(sc.SPAN_PREEMPTION)
        }
    )
    for s in core:
        assert 0.5 < s.attributes[sc.PREEMPTION_KV_USAGE] <= 1.0  # it preempts when the cache is full
        tree = internal[s.attributes[sc.REQUEST_INTERNAL_ID]]
        assert 0 < s.attributes[sc.PREEMPTION_RECOMPUTE_TOKENS] <= 40 + 200
        # the front end's llm.preemption of the same request starts at the same moment (vLLM's own
        # PREEMPTED timestamp, taken in the same call, converted by the front end's clock anchor)
        fe = tree["children"][sc.SPAN_PREEMPTION]
        assert min(abs(p.start_ns - s.start_ns) for p in fe) < 5_000_000
    for i, t in internal.items():  # and the front end's count of what is computed again is vLLM's
        mine = sorted(t["children"].get(sc.SPAN_PREEMPTION, []), key=lambda p: p.start_ns)
        theirs = sorted((s for s in core if s.attributes[sc.REQUEST_INTERNAL_ID] == i), key=lambda s: s.start_ns)
        assert [p.attributes[sc.PREEMPTION_RECOMPUTE_TOKENS] for p in mine] == [
            s.attributes[sc.PREEMPTION_RECOMPUTE_TOKENS] for s in theirs
        ]
    steps = [s for s in spans if s.name == sc.SPAN_STEP]
    assert len(steps) >= 200
    assert sum(s.attributes[sc.STEP_PREEMPTED] for s in steps) == total_preemptions
    # every output token but each request's first, and at most the first after each recompute,
    # comes from a step that gave that request exactly one token (a decode token)
    decode = sum(s.attributes[sc.STEP_DECODE_TOKENS] for s in steps)
    assert 32 * 199 - total_preemptions <= decode <= 32 * 199
    assert max(s.attributes[sc.STEP_KV_USAGE] for s in steps) > 0.9
    assert all(sc.STEP_GPU_TIME_NS not in s.attributes for s in steps)  # CPU: no GPU time
    assert all(s.resource["service.name"] == "vllm" for s in spans)


def test_instance_form(tmp_path, tiny_model):
    truth, spans = run_vllm_scenario(tmp_path, "instance", tiny_model)
    assert truth["same_object"] is True
    assert len(truth["warnings"]) == 1 and "llm.engine.step" in truth["warnings"][0]
    choices = [s for s in spans if s.name == sc.SPAN_REQUEST and sc.REQUEST_CHOICE in s.attributes]
    trees = request_trees([s for s in spans if s not in choices])
    assert set(trees) == {r["id"] for r in truth["requests"]}
    for tree in trees.values():
        check_nesting_and_order(tree)
        assert tree["root"].attributes[sc.OUTPUT_TOKENS] == 24
        # stats logging was on, so the engine core's own timestamps give the phases
        assert {sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE, sc.SPAN_STREAM} <= set(tree["children"])
    assert not [s for s in spans if s.name == sc.SPAN_STEP]  # said so in the warning
    assert Counter(s.name for s in spans)[sc.SPAN_REQUEST] == 16 + 2  # hooked once, not twice
    # SamplingParams(n=2): a request span per choice, its index on it, and a record each when derived
    assert sorted(s.attributes[sc.REQUEST_CHOICE] for s in choices) == [0, 1]
    assert {s.attributes[sc.REQUEST_ID] for s in choices} == {truth["n2"]["id"]}
    assert [s.attributes[sc.OUTPUT_TOKENS] for s in choices] == truth["n2"]["tokens"] == [6, 6]
    from collector.analysis.offline import batch_from_trace_file

    recs = batch_from_trace_file(str(tmp_path / "instance.jsonl")).records()
    n2 = sorted(r.request_id for r in recs if r.choice is not None)
    assert n2 == [f"{truth['n2']['id']}#0", f"{truth['n2']['id']}#1"]  # two records, neither a duplicate


def test_async_cancelled_mid_stream_and_traceparent(tmp_path, tiny_model):
    truth, spans = run_vllm_scenario(tmp_path, "async-abort", tiny_model)
    assert truth["cancelled"] == ["victim"]
    trees = request_trees(spans)
    assert set(trees) == {"ok-0", "ok-1", "victim"}
    victim = trees["victim"]["root"]
    assert victim.attributes[sc.STATUS] == "cancelled" and victim.status_code == 2
    assert victim.attributes[sc.OUTPUT_TOKENS] >= truth["seen"]["victim"] >= 5
    assert victim.attributes[sc.OUTPUT_TOKENS] < 400
    # what the engine core still made for it after the abort (the step under way): counted, not lost
    after = victim.attributes[sc.TOKENS_AFTER_ABORT]
    assert type(after) is int and after >= 0 and victim.attributes[sc.OUTPUT_TOKENS] + after < 400
    check_nesting_and_order(trees["victim"])
    for rid, n in (("ok-0", 32), ("ok-1", 48)):
        check_nesting_and_order(trees[rid])
        assert trees[rid]["root"].attributes[sc.OUTPUT_TOKENS] == n == truth["seen"][rid]
        assert trees[rid]["root"].attributes[sc.STATUS] == "ok"
        assert sc.TOKENS_AFTER_ABORT not in trees[rid]["root"].attributes
    _, trace_id, parent_id, _ = truth["traceparent"].split("-")
    ok0 = trees["ok-0"]["root"]
    assert ok0.trace_id == trace_id and ok0.parent_span_id == parent_id
    assert trees["ok-1"]["root"].trace_id != trace_id
    assert [s for s in spans if s.name == sc.SPAN_STEP]  # class form: step spans from the engine core


def test_queue_is_the_schedulers_queue(tmp_path, tiny_model):
    """With vLLM's own tracing on beside ours: each request's llm.queue is vLLM's
    gen_ai.latency.time_in_queue (QUEUED -> first SCHEDULED, the same scheduler timestamps) to well
    under a millisecond, and the front end's own time before it is llm.frontend (arrival ->
    QUEUED); together they span arrival -> first scheduled. At the default detail level, phases
    (test_detail_levels has the other two): every phase span, no engine-step span."""
    truth, spans = run_vllm_scenario(tmp_path, "own-tracing", tiny_model, env={"OTEL_LLM_DETAIL": "phases"})
    theirs = truth["time_in_queue"]
    trees = request_trees(spans)
    assert set(theirs) == set(trees) == {r["id"] for r in truth["requests"]}
    assert not {sc.SPAN_STEP, sc.SPAN_STEPS} & {s.name for s in spans}
    for rid, tree in trees.items():
        for name in (sc.SPAN_FRONTEND, sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE, sc.SPAN_STREAM):
            assert len(tree["children"][name]) == 1, name
        (q,) = tree["children"][sc.SPAN_QUEUE]
        (fe,) = tree["children"][sc.SPAN_FRONTEND]
        (pf,) = tree["children"][sc.SPAN_PREFILL]
        assert abs((q.end_ns - q.start_ns) / 1e9 - theirs[rid]) < 5e-5, rid
        assert tree["root"].start_ns == fe.start_ns and fe.end_ns == q.start_ns and q.end_ns == pf.start_ns
        assert fe.end_ns > fe.start_ns  # rendering and the hand-off take time


@pytest.mark.parametrize("detail", ["steps", "request"])
def test_detail_levels(tmp_path, tiny_model, detail):
    """OTEL_LLM_DETAIL decides which spans vLLM's front end and engine core emit, and none is lost
    (the default, phases, is test_queue_is_the_schedulers_queue's: phase spans, no step spans)
    from the engine core's process. vLLM's CPU platform always starts that process with spawn (it
    sets VLLM_WORKER_MULTIPROC_METHOD=spawn whatever was asked); fork is tested on the pipeline
    itself, in tests/unit/test_fork.py."""
    truth, spans = run_vllm_scenario(
        tmp_path, "class", tiny_model, env={"OTEL_LLM_DETAIL": detail, "VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    )
    assert truth["mp_method"] == "spawn"  # the CPU platform's override (if this changes, fork is tested here too)
    # vLLM's statistics, which the caller did not ask for, are on in its engine core (the queue and
    # prefill spans below come from them) and off in its front end, as in the plain vllm.LLM: no
    # stat loggers, no RequestOutput.metrics
    assert truth["front_end_stats"] == [False, False, [False] * 24]
    reqs = {r["id"]: r for r in truth["requests"]}
    names = Counter(s.name for s in spans)
    roots = {s.attributes[sc.REQUEST_ID]: s for s in spans if s.name == sc.SPAN_REQUEST}
    assert set(roots) == set(reqs) and names[sc.SPAN_REQUEST] == 24
    for rid, root in roots.items():  # every level: the request span with its token events
        assert root.attributes[sc.OUTPUT_TOKENS] == reqs[rid]["tokens"] == 32
        assert sum(root.attributes[sc.TOKEN_EVENT_TOKENS]) == 32
    phases = (sc.SPAN_FRONTEND, sc.SPAN_QUEUE, sc.SPAN_PREFILL, sc.SPAN_DECODE, sc.SPAN_STREAM)
    if detail == "request":
        assert set(names) == {sc.SPAN_REQUEST}
        return
    assert all(names[p] == 24 for p in phases), names
    steps = [s for s in spans if s.name == sc.SPAN_STEP]
    # no speculative decoding: its scheduler is not wrapped for it, and no step says anything of drafts
    assert sc.SPAN_ENGINE_SPECULATION not in names
    assert not any(sc.STEP_DRAFT_TOKENS in s.attributes for s in steps)
    # steps: the engine core's spans arrived from the child process, all of them: every token
    # generated is in a step (24 prompts prefilled, then decode steps of one token each)
    assert sum(s.attributes[sc.STEP_DECODE_TOKENS] for s in steps) == 24 * 31
    prefill = sum(s.attributes[sc.STEP_PREFILL_TOKENS] for s in steps)
    assert prefill == 24 * 40 == sum(r.attributes[sc.PREFILL_COMPUTED_TOKENS] for r in roots.values())


def test_prefix_cache_tokens_agree_with_vllm(tmp_path, tiny_model):
    """gen_ai.usage.cache_read.input_tokens is what vLLM's RequestOutput.num_cached_tokens says,
    request by request, and the prompt's tokens add up: computed + cached = the prompt."""
    truth, spans = run_vllm_scenario(tmp_path, "prefix", tiny_model)
    roots = {s.attributes[sc.REQUEST_ID]: s for s in spans if s.name == sc.SPAN_REQUEST}
    cached = []
    for r in truth["requests"]:
        a = roots[r["id"]].attributes
        assert a[sc.CACHE_READ_INPUT_TOKENS] == r["cached"], r
        assert a[sc.PREFILL_COMPUTED_TOKENS] + a[sc.CACHE_READ_INPUT_TOKENS] == r["prompt"] == a[sc.INPUT_TOKENS]
        assert a[sc.PREFILL_LOCAL_CACHED_TOKENS] == r["cached"] and a[sc.PREFILL_EXTERNAL_CACHED_TOKENS] == 0
        cached.append(r["cached"])
    assert cached == [0, 256, 256, 0]  # two whole blocks of the repeated prompt; the new one: nothing


def test_a_wall_clock_step_moves_no_token_before_its_arrival(tmp_path, tiny_model):
    """The front end's wall clock steps 40 ms ahead after the anchor was taken (chrony on a VM):
    vLLM's arrival_time (time.time()) must not move against the monotonic times of everything
    else. Before, arrival came 40 ms late: tokens at offset 0 (TTFT 0), QUEUED before arrival
    (the front-end part lost), as loaded vLLM servers showed with vLLM's benchmark client."""
    truth, spans = run_vllm_scenario(tmp_path, "clock-step", tiny_model)
    trees = request_trees(spans)
    ids = {r["id"] for r in truth["requests"]}
    assert ids <= set(trees) and len(ids) == 16
    for rid in ids:
        tree = trees[rid]
        check_nesting_and_order(tree)
        root = tree["root"]
        offsets = root.attributes[sc.TOKEN_EVENT_OFFSETS]
        front_end = tree["children"][sc.SPAN_FRONTEND][0]
        queue = tree["children"][sc.SPAN_QUEUE][0]
        assert offsets[0] > 0, rid  # the first token after the arrival
        assert front_end.start_ns == root.start_ns and front_end.duration_ns > 0
        assert root.start_ns < queue.start_ns <= tree["children"][sc.SPAN_PREFILL][0].start_ns
