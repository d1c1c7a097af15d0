"""Benchmark: what the vLLM front end's hooks cost, in instructions (callgrind), without an engine.

One batch as the hooks see it, replayed on a stand-in ``OutputProcessor`` hooked by
``engine_hooks.vllm.frontend.instrument_output_processor``: ``--requests`` requests arrive
(``add_request``), then ``--tokens`` steps hand out one token each (``process_outputs``, on
vLLM's own ``EngineCoreOutput`` objects: the first with the engine core's QUEUED and SCHEDULED
events, the last with a finish reason, as ``benchmarks/frontend_cost.py`` makes them). Two
counts, the two parts of the front end's cost that are ours:

* ``engine thread``: the hooks as the engine's thread runs them (the arrival's fields, the C scan
  of each step's outputs, the recorded events);
* ``round``: what the pipeline does with them in the front end when it sends the round to its
  span process (the steps' outputs expanded, the batch pickled and written); the span process's
  own work is not counted here (``cost_count.py`` counts it).

The same batch through a real engine is what ``cost_count.py`` counts (offline and behind the
server), with an engine's start under valgrind for each variant and, behind the server, more
noise between starts; this takes about a minute and repeats within 0.1% (the round: 1,525,287
and 1,526,705 instructions in two runs of an earlier version; at 2026-12-05's 887,509 and
1,121,755 for the engine thread and the round, 2.01 M in all, down from 2.97 M). The cyclic garbage
collector is off while counting: its share is the engine's heap's (``cost_count.py`` has it).

Run: ``.venv/bin/python benchmarks/hooks_cost.py [--requests 32] [--tokens 64]``. Needs valgrind.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import counted


def drive(n_requests: int, n_tokens: int) -> None:
    """The counted process (:mod:`counted`): the batch made before counting starts; ``GO
    engine`` runs its hooks, ``GO round`` sends what they recorded to the span process."""
    import gc

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from frontend_cost import StandInOutputProcessor, StandInRequest, step_outputs

    from engine_hooks.api import EngineHooks
    from engine_hooks.vllm.frontend import instrument_output_processor

    op = StandInOutputProcessor()
    hooks = EngineHooks(engine="vllm", service_name="hooks-cost")
    instrument_output_processor(op, hooks, "tiny")
    pipeline = hooks.pipeline

    def batch(name: str, requests: int, tokens: int) -> tuple[list, list]:
        steps = step_outputs(requests, tokens)
        for outputs in steps:
            for o in outputs:
                o.request_id = f"{name}-{o.request_id}-x1"
        return [StandInRequest(f"{name}-r{i}") for i in range(requests)], steps

    def run(requests: list, steps: list) -> None:
        for r in requests:
            op.add_request(r)
        t = time.monotonic()
        for outputs in steps:
            t += 0.01
            op.process_outputs(outputs, t)

    gc.disable()
    for i in range(2):  # warm: every code path specialized, the span process started
        run(*batch(f"w{i}", 4, 4))
        pipeline.flush()
    prepared = batch("b", n_requests, n_tokens)
    print("READY", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "GO":
            break
        if parts[1] == "engine":
            run(*prepared)
        else:
            pipeline.flush()
        print("DONE", flush=True)
    pipeline.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = counted.parser(__doc__)
    ap.add_argument("--requests", type=int, default=32, help="requests in the batch (default 32)")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens each, one a step (default 64)")
    args = ap.parse_args(argv)
    if args.drive:
        drive(args.requests, args.tokens)
        return 0

    with tempfile.TemporaryDirectory(prefix="hooks-cost-") as out:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_"))}
        env.update(OTEL_LLM_TRACES_FILE=os.path.join(out, "spans.jsonl"), OTEL_LLM_SCHEDULE_DELAY=str(10**9))
        size = ("--requests", str(args.requests), "--tokens", str(args.tokens))
        engine, sent = counted.count_steps(__file__, ["engine", "round"], env, size)
    n = args.requests * args.tokens
    print(f"\nthe vLLM front end's hooks, one batch of {args.requests} x {args.tokens} (k = 1,000 instructions):\n")
    print("| part | a batch | a request | an output token |")
    print("|---|---|---|---|")
    for name, total in (("engine thread", engine), ("round to the span process", sent), ("both", engine + sent)):
        print(f"| {name} | {total / 1e6:.2f} M | {total / args.requests / 1000:.1f} k | {total / n / 1000:.2f} k |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
