"""A tiny continuous-batching engine traced with the generic hook API (one decorator per
lifecycle method). It schedules requests under a KV-cache budget, preempts (recompute) when the
budget runs out, emits one token per running request per step and finishes at ``max_tokens``.

Run from the repository root, in its virtual environment (``make venv``):
``OTEL_LLM_TRACES_FILE=/tmp/toy.jsonl .venv/bin/python examples/toy_engine.py``, then
``.venv/bin/otel-llm analyze --traces /tmp/toy.jsonl --boundary engine``; or point ``OTEL_EXPORTER_OTLP_ENDPOINT`` at a
collector.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine_hooks import EngineHooks

hooks = EngineHooks(engine="toy-engine", model="toy")


@dataclass
class Request:
    id: str
    prompt_len: int
    max_tokens: int
    traceparent: str | None = None
    generated: int = 0
    computed: int = 0  # tokens whose KV is held
    output: list[int] = field(default_factory=list)

    @property
    def kv_tokens(self) -> int:
        return self.prompt_len + self.generated


@dataclass
class Plan:
    batch: list[Request]
    newly_scheduled: list[str]
    prefill_tokens: int
    decode_tokens: int
    preempted: int


class ToyEngine:
    def __init__(self, kv_capacity: int = 4096, max_batch: int = 16, step_time_s: float = 0.001):
        self.kv_capacity, self.max_batch, self.step_time_s = kv_capacity, max_batch, step_time_s
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.done: dict[str, tuple[str, list[int]]] = {}

    @hooks.arrival(
        request_id=lambda res, self, req: req.id,
        input_tokens=lambda res, self, req: req.prompt_len,
        trace_headers=lambda res, self, req: {"traceparent": req.traceparent} if req.traceparent else None,
    )
    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    @hooks.preempt(
        request_id=lambda res, self, req: req.id,
        mode="recompute",
        kv_usage=lambda res, self, req: sum(r.kv_tokens for r in self.running) / self.kv_capacity,
        recompute_tokens=lambda res, self, req: req.computed,
    )
    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.computed = 0  # recompute: KV dropped, prompt and output so far are prefilled again
        self.waiting.insert(0, req)

    @hooks.schedule(scheduled=lambda plan, self: plan.newly_scheduled)
    def schedule(self) -> Plan:
        preempted = 0
        # grow running requests by one token; preempt the newest while the KV budget is exceeded
        while self.running and sum(r.kv_tokens + 1 for r in self.running) > self.kv_capacity:
            self.preempt(self.running[-1])
            preempted += 1
        new = []
        while self.waiting and len(self.running) < self.max_batch:
            cand = self.waiting[0]
            if sum(r.kv_tokens + 1 for r in self.running) + cand.kv_tokens + 1 > self.kv_capacity:
                break
            self.running.append(self.waiting.pop(0))
            new.append(cand.id)
        prefill = sum(r.kv_tokens for r in self.running if r.computed == 0)
        decode = sum(1 for r in self.running if r.computed > 0)
        return Plan(list(self.running), new, prefill, decode, preempted)

    @hooks.step(
        batch_size=lambda outs, self, plan: len(plan.batch),
        prefill_tokens=lambda outs, self, plan: plan.prefill_tokens,
        decode_tokens=lambda outs, self, plan: plan.decode_tokens,
        preempted=lambda outs, self, plan: plan.preempted,
        kv_usage=lambda outs, self, plan: sum(r.kv_tokens for r in plan.batch) / self.kv_capacity,
    )
    def execute(self, plan: Plan) -> list[tuple[Request, int]]:
        time.sleep(self.step_time_s)
        outs = []
        for r in plan.batch:
            r.computed = r.kv_tokens
            tok = hash((r.id, r.generated)) & 0x1FF
            r.output.append(tok)
            r.generated += 1
            outs.append((r, 1))
        return outs

    @hooks.token_out(outputs=lambda _, self, outs: [(r.id, n) for r, n in outs])
    def emit(self, outs: list[tuple[Request, int]]) -> None:
        for r, _ in outs:
            if r.generated >= r.max_tokens:
                self.finish(r, "ok")

    @hooks.finish(request_id=lambda res, self, req, status: req.id, status=lambda res, self, req, status: status)
    def finish(self, req: Request, status: str) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.done[req.id] = (status, list(req.output))

    def abort(self, request_id: str) -> None:
        for r in self.running + self.waiting:
            if r.id == request_id:
                self.finish(r, "cancelled")

    def step(self) -> None:
        self.emit(self.execute(self.schedule()))

    def run(self, max_steps: int = 100_000) -> dict[str, tuple[str, list[int]]]:
        for _ in range(max_steps):
            if not (self.running or self.waiting):
                break
            self.step()
        return self.done


def main() -> None:
    engine = ToyEngine(kv_capacity=600, max_batch=8)
    for i in range(12):
        engine.add_request(Request(f"toy-{i}", prompt_len=40 + 5 * i, max_tokens=20 + 3 * i))
    done = engine.run()
    hooks.pipeline.shutdown()
    c = hooks.pipeline.counters
    print(
        f"{len(done)} requests done; {c.requests_traced} traced, {c.steps_traced} steps, "
        f"{c.spans_exported} spans exported, {c.spans_dropped} dropped"
    )


if __name__ == "__main__":
    main()
