"""An asyncio engine traced with the generic hook API: ``async def`` lifecycle methods, a step that
awaits its forward pass, tokens marked when generated and again when a per-request stream (an async
generator) hands them to the caller. The shape of docs/engine_hooks.md, in about 60 lines.

Run: ``OTEL_LLM_TRACES_FILE=/tmp/async.jsonl python examples/async_engine.py``.
"""

from __future__ import annotations

import asyncio

from engine_hooks import EngineHooks

hooks = EngineHooks(engine="async-toy", model="toy")


class AsyncEngine:
    def __init__(self, step_s: float = 0.005):
        self.step_s = step_s
        self.waiting: list[tuple[str, int]] = []  # (request id, tokens wanted)
        self.running: dict[str, int] = {}  # request id -> tokens still to make
        self.queues: dict[str, asyncio.Queue] = {}

    @hooks.arrival(request_id=lambda res, self, rid, n: rid, input_tokens=lambda res, self, rid, n: 16)
    async def add_request(self, rid: str, n: int) -> None:
        if n <= 0:
            raise ValueError("max_tokens must be positive")
        self.queues[rid] = asyncio.Queue()
        self.waiting.append((rid, n))

    @hooks.schedule(scheduled=lambda new, self: new)
    async def schedule(self) -> list[str]:
        new = [rid for rid, _ in self.waiting]
        self.running.update(self.waiting)
        self.waiting.clear()
        return new

    @hooks.step(batch_size=lambda res, self: len(res))
    async def forward(self) -> list[str]:
        await asyncio.sleep(self.step_s)  # the forward pass
        return list(self.running)

    @hooks.generated(outputs=lambda _, self, ids: [(rid, 1) for rid in ids])
    async def sample(self, ids: list[str]) -> None:
        for rid in ids:
            left = self.running.pop(rid) - 1
            if left:
                self.running[rid] = left
            await self.queues[rid].put(left == 0)

    @hooks.token_out(outputs=lambda item, self, rid: [(rid, 1)])
    async def stream(self, rid: str):
        while True:
            last = await self.queues[rid].get()
            yield "tok"
            if last:
                await self.finish(rid)
                return

    @hooks.finish(request_id=lambda res, self, rid: rid)
    async def finish(self, rid: str) -> None:
        self.running.pop(rid, None)

    async def run_steps(self) -> None:
        while self.running or self.waiting:
            await self.schedule()
            await self.sample(await self.forward())
            await asyncio.sleep(0)


async def main() -> None:
    engine = AsyncEngine()
    for i in range(4):
        await engine.add_request(f"a{i}", 8)

    async def read(rid: str) -> int:
        return len([t async for t in engine.stream(rid)])

    counts = await asyncio.gather(engine.run_steps(), *(read(f"a{i}") for i in range(4)))
    print(f"tokens per request: {counts[1:]}")
    hooks.pipeline.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
