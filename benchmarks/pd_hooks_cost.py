"""Benchmark: what the P/D hooks add per request on each engine, in instructions (callgrind).

A disaggregated request calls, on the decode engine's thread, the scheduler's
``_set_kv_fetch_stage`` five times (taken twice, load started, transfer seen complete, scheduled),
``_connector_finished`` and ``_free_blocks`` once each, and in its connector worker
``_pop_done_transfers`` with one of its transfer handles done (NIXL's telemetry read); on the
prefill engine's thread, ``_connector_finished`` (which keeps the blocks) and ``_free_blocks``
(when the decode side has read them). Those calls are replayed on stand-ins shaped as vLLM
0.32's ``Scheduler`` and ``NixlBaseConnectorWorker`` (the methods themselves do nothing: what is
counted is ours), each side twice, plain and hooked (``engine_hooks.vllm.kv_fetch``), and the
difference is what the hooks add on that engine's thread. ``round``: what the pipeline then does
with what they recorded (expanded, the round sent to its span process; the span process's own work
is not counted here).

Run: ``make cost-pd`` or ``.venv/bin/python benchmarks/pd_hooks_cost.py [--requests 256]``. Needs valgrind.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import counted


def stand_ins():
    """Fresh stand-in classes (a plain pair and, made again, a pair to hook)."""

    class Scheduler:
        def __init__(self):
            self.connector = object()

        def _set_kv_fetch_stage(self, request, stage):
            return None

        def _connector_finished(self, request):
            params = request.kv_transfer_params
            if params.get("do_remote_decode"):
                return True, {"do_remote_prefill": True, "remote_block_ids": [1], "remote_request_id": "p"}
            return False, None

        def _free_blocks(self, request):
            return None

    class Telemetry:
        totalBytes, xferDuration, postDuration = 65536, 900, 20

    class Agent:
        def get_xfer_telemetry(self, handle):
            return Telemetry

    class Worker:
        def __init__(self):
            self.nixl_wrapper = Agent()

        def _pop_done_transfers(self, transfers):
            done = set()
            for rid, handles in list(transfers.items()):
                for h in handles:
                    self.nixl_wrapper.get_xfer_telemetry(h)
                done.add(rid)
                del transfers[rid]
            return done, set()

    return Scheduler, Worker


class Request:
    __slots__ = ("kv_transfer_params", "request_id")

    def __init__(self, rid: str, params: dict):
        self.request_id, self.kv_transfer_params = rid, params


def drive(n: int) -> None:
    import gc

    from engine_hooks.api import EngineHooks
    from engine_hooks.vllm.kv_fetch import hook_kv_fetch, hook_nixl_telemetry

    hooks = EngineHooks(engine="vllm", service_name="pd-hooks-cost", detail="phases")
    plain_s, plain_w = stand_ins()
    hooked_s, hooked_w = stand_ins()
    hooked_sched = hooked_s()
    assert hook_kv_fetch(hooked_sched, hooks) and hook_nixl_telemetry(hooks, hooked_w)
    sides = {"plain": (plain_s(), plain_w()), "hooked": (hooked_sched, hooked_w())}

    def decode(s, w, name: str) -> None:
        for i in range(n):
            r = Request(f"{name}-d{i}", {"do_remote_prefill": True, "remote_block_ids": [1]})
            s._set_kv_fetch_stage(r, "waiting_to_start")
            s._set_kv_fetch_stage(r, "waiting_to_start")
            s._set_kv_fetch_stage(r, "in_progress")
            w._pop_done_transfers({r.request_id: [i]})
            s._set_kv_fetch_stage(r, "completed_waiting")
            s._set_kv_fetch_stage(r, None)
            s._connector_finished(r)
            s._free_blocks(r)

    def prefill(s, w, name: str) -> None:
        for i in range(n):
            r = Request(f"{name}-p{i}", {"do_remote_decode": True})
            s._connector_finished(r)
            s._free_blocks(r)

    gc.disable()
    for side in ("plain", "hooked"):  # warm: every path specialized, the span process started
        decode(*sides[side], f"w{side}")
        prefill(*sides[side], f"w{side}")
    hooks.pipeline.flush()
    print("READY", flush=True)
    for k, line in enumerate(sys.stdin):
        parts = line.split()
        if not parts or parts[0] != "GO":
            break
        if parts[1] == "round":
            hooks.pipeline.flush()
        else:
            leg, side = parts[1].split("-")
            (decode if leg == "decode" else prefill)(*sides[side], f"{k}")
        print("DONE", flush=True)
    hooks.pipeline.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = counted.parser(__doc__)
    ap.add_argument("--requests", type=int, default=256, help="requests on each side (default 256)")
    args = ap.parse_args(argv)
    if args.drive:
        drive(args.requests)
        return 0
    steps = ["decode-plain", "decode-hooked", "prefill-plain", "prefill-hooked", "round"]
    with tempfile.TemporaryDirectory(prefix="pd-hooks-cost-") as out:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_"))}
        env.update(OTEL_LLM_TRACES_FILE=os.path.join(out, "spans.jsonl"), OTEL_LLM_SCHEDULE_DELAY=str(10**9))
        dp, dh, pp, ph, sent = counted.count_steps(__file__, steps, env, ("--requests", str(args.requests)))
    n = args.requests
    print(f"\nthe P/D hooks, {n} requests on each side (k = 1,000 instructions):\n")
    print("| engine | plain calls, a request | hooked, a request | the hooks add, a request |")
    print("|---|---|---|---|")
    for name, plain, hooked in (("decode", dp, dh), ("prefill", pp, ph)):
        print(
            f"| {name} | {plain / n / 1000:.1f} k | {hooked / n / 1000:.1f} k | {(hooked - plain) / n / 1000:.1f} k |"
        )
    print(f"| the round (both sides' records to the span process) | | | {sent / (2 * n) / 1000:.1f} k |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
