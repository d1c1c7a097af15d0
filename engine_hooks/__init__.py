"""engine_hooks: trace an LLM engine from the inside.

* :func:`instrument`: ``LLM = engine_hooks.instrument(vllm.LLM)``, or ``engine_hooks.instrument(model)``
  for transformers continuous batching.
* :class:`EngineHooks`: the generic decorator API for any batching engine.
* :class:`CudaEventTimer`: GPU time per step (``EngineHooks(gpu_timer=CudaEventTimer.if_available())``).
* :func:`trace_proxy`: ``app = engine_hooks.trace_proxy(app)`` for a Python ASGI proxy or router in
  front of the engines (a disaggregated deployment's P/D proxy): its server span, and its
  ``traceparent`` on the calls it makes.
* :func:`flush`: export everything recorded so far.
"""

from .api import EngineHooks
from .asgi import trace_proxy
from .hot_path.gpu_timer import CudaEventTimer
from .pipeline import TracingPipeline, default_pipeline, flush


def instrument(target):
    """Trace an engine with one call:

    * vLLM: ``vllm.LLM``, ``AsyncLLM`` or ``LLMEngine`` (a class: returns a traced subclass; an
      engine already built: hooks it in place). See :func:`engine_hooks.vllm.instrument`.
    * transformers continuous batching: a model (``generate_batch``, ``init_continuous_batching``)
      or its ``ContinuousBatchingManager``, hooked in place. See :mod:`engine_hooks.transformers`.
    """
    from .transformers import instrument as _transformers
    from .transformers import is_transformers_target

    if not isinstance(target, type) and is_transformers_target(target):
        return _transformers(target)
    from .vllm import instrument as _instrument

    return _instrument(target)


__all__ = ["CudaEventTimer", "EngineHooks", "TracingPipeline", "default_pipeline", "flush", "instrument", "trace_proxy"]
