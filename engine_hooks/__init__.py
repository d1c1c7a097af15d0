"""engine_hooks: trace an LLM engine from the inside.

* :func:`instrument` (vLLM): ``LLM = engine_hooks.instrument(vllm.LLM)``.
* :class:`EngineHooks`: the generic decorator API for any batching engine.
* :class:`CudaEventTimer`: GPU time per step (``EngineHooks(gpu_timer=CudaEventTimer.if_available())``).
* :func:`flush`: export everything recorded so far.
"""

from .api import EngineHooks
from .gpu_timer import CudaEventTimer
from .pipeline import TracingPipeline, default_pipeline, flush


def instrument(target):
    """Trace a vLLM engine: ``vllm.LLM``, ``AsyncLLM`` or ``LLMEngine`` (a class: returns a traced
    subclass; an engine already built: hooks it in place). See :func:`engine_hooks.vllm.instrument`."""
    from .vllm import instrument as _instrument

    return _instrument(target)


__all__ = ["CudaEventTimer", "EngineHooks", "TracingPipeline", "default_pipeline", "flush", "instrument"]
