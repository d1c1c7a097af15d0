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


class _AfterImport:
    """Import hook: run ``patches[name](module)`` once the module ``name`` is loaded."""

    patches: ClassVar[dict] = {
        "vllm.distributed.device_communicators.shm_broadcast": _no_spin,
        "vllm.v1.engine.core": _engine_core,
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
