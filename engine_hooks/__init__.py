"""engine_hooks: trace an LLM engine from the inside.

* :func:`instrument` (vLLM): ``LLM = engine_hooks.instrument(vllm.LLM)``.
* :class:`EngineHooks`: the generic decorator API for any batching engine.
* :func:`flush`: export everything recorded so far.
"""

from .api import EngineHooks
from .pipeline import TracingPipeline, default_pipeline, flush


def instrument(target, **kwargs):
    """Trace a vLLM engine class (``vllm.LLM``, ``AsyncLLM``) or an engine already built."""
    from .vllm import instrument as _instrument

    return _instrument(target, **kwargs)


__all__ = ["EngineHooks", "TracingPipeline", "default_pipeline", "flush", "instrument"]
