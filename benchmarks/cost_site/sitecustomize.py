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
* In the server mode, the API server gets control routes (``/otel-llm/pause``, ``wait``,
  ``resume``, ``flush``) that do for the HTTP client what the offline driver does in its own
  process: every request of a batch waits in the scheduler before its first step.
"""

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


class _AfterImport:
    """Import hook: run ``patches[name](module)`` once the module ``name`` is loaded."""

    patches: ClassVar[dict] = {
        "vllm.distributed.device_communicators.shm_broadcast": _no_spin,
        "vllm.v1.engine.core": _engine_core,
        "vllm.v1.engine.output_processor": _output_processor,
        "vllm.entrypoints.launchers.app": _api_app,
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
