"""Loaded by every Python process of a ``benchmarks/cost_count.py`` run (its PYTHONPATH), never
by the product. It makes an instruction count repeatable in vLLM's processes:

* vLLM's shared-memory queues spin (``sched_yield``) for a second after each read before they
  block: how often they spin depends on the wall clock, which callgrind slows 50-fold. Here their
  readers block at once (``busy_loop_s=0``), in every variant alike.
* The span thread's round (build and export what is held) runs on a wall-clock timer, which the
  run sets out of reach; :func:`flush_spans` runs that round at the end of each measured batch
  instead, so its work is counted once. In the engine core it is a utility method the driver
  calls (``EngineCore.otel_llm_flush_spans``, added here), run by the engine core's own loop,
  which also returns how many engine steps ran the model.
* The wall-clock timers of the server mode's front end wake only when needed (uvicorn's main
  loop, vLLM's watchdog; vLLM's periodic stats log line is set out of reach by the run,
  ``VLLM_LOG_STATS_INTERVAL``).
* In the server mode, the API server gets control routes (``/otel-llm/pause``, ``wait``,
  ``resume``, ``flush``) that do for the HTTP client what the offline driver does in its own
  process: every request of a batch waits in the scheduler before its first step.
* Before each counted batch the front end's heap is settled (:func:`settle_heap`).
"""

import gc
import os
import sys
from typing import ClassVar


def flush_spans() -> None:
    """Build and export every span this process holds now: ours, and vLLM's own tracing's."""
    pipeline = sys.modules.get("engine_hooks.pipeline")
    if pipeline is not None:
        for p in list(pipeline._live_pipelines):
            p.flush()  # with a span process: until it has exported what it was sent
    otel = sys.modules.get("opentelemetry.trace")
    if otel is not None:
        provider = otel.get_tracer_provider()
        if hasattr(provider, "force_flush"):
            provider.force_flush()


def settle_heap() -> None:
    """Before each counted batch, outside the count (the offline driver's PREP, the server's
    ``/otel-llm/pause``): collect every generation, and leave the collections of the older two out
    of the batch. Every variant starts a batch with the same empty young generations, and a batch
    counts only the youngest's collections, one for each 700 objects a process keeps allocating:
    what tracing adds to them is counted. An older generation is collected when a count crosses
    a threshold, and whether a batch crossed one depended on timing: a batch behind the server
    took 12 young collections plain and 12 plus one of the middle generation (8,000 objects,
    about 2.5 M instructions) traced, or not, from one engine start to the next."""
    gc.collect()
    gc.set_threshold(gc.get_threshold()[0], 1 << 30, 1 << 30)


def _no_spin(module) -> None:
    init = module.SpinCondition.__init__
    init.__defaults__ = (*init.__defaults__[:-1], 0)  # busy_loop_s


def _engine_core(module) -> None:
    """``EngineCore.otel_llm_flush_spans()``: flush, and return the steps that ran the model since
    the last call (counted here: the front end's ``step()`` calls are not the engine's steps)."""
    core, proc = module.EngineCore, module.EngineCoreProc  # the busy loop is the process's
    process_step = proc._process_engine_step
    steps = [0]

    def _process_engine_step(self):
        executed = process_step(self)
        steps[0] += bool(executed)
        return executed

    def otel_llm_flush_spans(self) -> int:
        flush_spans()
        n, steps[0] = steps[0], 0
        return n

    proc._process_engine_step = _process_engine_step
    core.otel_llm_flush_spans = otel_llm_flush_spans


#: the server mode's wait for a batch: (requests the front end must hold, the event set then)
_waiting: list = []


def _output_processor(module) -> None:
    """``OutputProcessor.add_request`` tells the server's ``/otel-llm/wait`` when the batch is in
    (every variant alike: the same wrapper, the same work per request)."""
    cls = module.OutputProcessor
    add = cls.add_request

    def add_request(self, *a, **k):
        out = add(self, *a, **k)
        if _waiting and self.get_num_unfinished_requests() >= _waiting[0][0]:
            _waiting[0][1].set()
        return out

    cls.add_request = add_request


def _api_app(module) -> None:
    """The API server's control routes for the server mode (``/otel-llm/...``): pause the
    scheduler (requests wait for the first step), wait until the batch is in the front end,
    resume, and flush (this process's span round and the engine core's; returns its steps)."""
    build_app = module.build_app

    def build_app_with_control(*a, **k):
        import asyncio

        from fastapi import Request

        app = build_app(*a, **k)

        def core(request: Request):
            return request.app.state.engine_client.engine_core

        @app.post("/otel-llm/pause")
        async def pause(request: Request):
            await core(request).call_utility_async("pause_scheduler", "keep", False)
            settle_heap()
            return {"ok": True}

        @app.post("/otel-llm/resume")
        async def resume(request: Request):
            await core(request).call_utility_async("resume_scheduler")
            return {"ok": True}

        @app.get("/otel-llm/wait")
        async def wait(request: Request, n: int):
            op = request.app.state.engine_client.output_processor
            event = asyncio.Event()
            _waiting[:] = [(n, event)]
            if op.get_num_unfinished_requests() < n:
                await event.wait()
            _waiting.clear()
            return {"ok": True}

        @app.post("/otel-llm/flush")
        async def flush(request: Request):
            flush_spans()
            return {"steps": await core(request).call_utility_async("otel_llm_flush_spans")}

        return app

    module.build_app = build_app_with_control


def _uvicorn_server(module) -> None:
    """uvicorn's main loop wakes every 0.1 s of wall clock (``on_tick``: its Date header, the exit
    check): some 500 times in a batch under callgrind's slower clock, a few million instructions
    that grew with the batch's wall time (the machine's load, and tracing's own slowing, counted as
    tracing's cost). Here it wakes when the server is told to exit: SIGINT and SIGTERM through the
    event loop's own signal handling (its wakeup fd: a signal that lands on another thread still
    wakes it), where the loop runs on the main thread; elsewhere uvicorn's loop as it is."""
    import asyncio
    import signal

    server = module.Server
    ticking, handle_exit = server.main_loop, server.handle_exit

    async def main_loop(self) -> None:
        loop = asyncio.get_running_loop()
        self._otel_llm_wake = wake = asyncio.Event()
        self._otel_llm_loop = loop
        added = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
                added.append(sig)
            except (ValueError, RuntimeError, NotImplementedError):  # not the main thread's loop
                break
        try:
            if len(added) < 2:
                await ticking(self)
                return
            should_exit = await self.on_tick(0)
            while not should_exit:
                await wake.wait()
                wake.clear()
                should_exit = await self.on_tick(0)
        finally:
            for sig in added:  # uvicorn's own handlers are put back as it exits
                loop.remove_signal_handler(sig)

    def handle_exit_and_wake(self, sig, frame) -> None:
        handle_exit(self, sig, frame)
        wake = getattr(self, "_otel_llm_wake", None)
        if wake is not None:
            self._otel_llm_loop.call_soon_threadsafe(wake.set)

    server.main_loop = main_loop
    server.handle_exit = handle_exit_and_wake


def _launcher(module) -> None:
    """vLLM's watchdog wakes every 5 s of wall clock to look for a dead engine: once an hour here
    (a batch whose engine died fails on its own timeout)."""
    import asyncio

    async def watchdog_loop(server, engine) -> None:
        while True:
            await asyncio.sleep(3600)
            module.terminate_if_errored(server, engine)

    module.watchdog_loop = watchdog_loop


class _AfterImport:
    """Import hook: run ``patches[name](module)`` once the module ``name`` is loaded."""

    patches: ClassVar[dict] = {
        "vllm.distributed.device_communicators.shm_broadcast": _no_spin,
        "vllm.v1.engine.core": _engine_core,
        "vllm.v1.engine.output_processor": _output_processor,
        "vllm.entrypoints.launchers.app": _api_app,
        "vllm.entrypoints.launchers.launcher": _launcher,
        "uvicorn.server": _uvicorn_server,
    }

    def find_spec(self, fullname, path=None, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        import importlib.util

        sys.meta_path.remove(self)  # find the real spec without this hook
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("OTEL_LLM_COST_COUNT"):
    sys.meta_path.insert(0, _AfterImport())
