"""vLLM general plugin (entry point ``vllm.general_plugins``): runs in every vLLM process.

With ``OTEL_LLM_ENABLE=1`` in the environment:
* in the engine-core process it hooks the scheduler (step spans);
* in the front-end process (``vllm serve`` / the OpenAI API server) it hooks every
  ``OutputProcessor`` and ``AsyncLLM`` built from then on (request spans, and the caller's W3C
  ``traceparent`` joined), and adds the HTTP server span's ASGI middleware to the app
  (:mod:`engine_hooks.asgi`).
Without it, the plugin does nothing. ``instrument()`` sets the variable while it builds an engine,
with ``OTEL_LLM_FRONTEND=0`` so that only that engine's front end is hooked.
"""

from __future__ import annotations

import logging

from otel_llm import environment

log = logging.getLogger("engine_hooks")

ENV_ENABLE = environment.ENABLE
ENV_FRONTEND = environment.FRONTEND


def enabled() -> bool:
    return environment.env_bool(ENV_ENABLE)


_announced = False


def announce() -> None:
    """Say once, in the server's own log, that tracing is on and where the spans go (called when
    the plugin hooks the first front end: the API server's process, not the engine core's): at INFO,
    or at WARNING where vLLM logs no INFO (``VLLM_LOGGING_LEVEL=WARNING``), which would hide it and
    leave vLLM's own "tracing is disabled" warning (about its own tracing) as the only word."""
    global _announced
    if _announced:
        return
    _announced = True
    from otel_llm.otlp.export import destination

    detail = environment.detail_level()
    logger = logging.getLogger("vllm.otel_llm")
    logger.log(
        logging.INFO if logger.isEnabledFor(logging.INFO) else logging.WARNING,
        "otel-llm: tracing this vLLM server (%s=1) at %s=%s: %s; to %s. (vLLM's own warning 'Received a "
        "request with trace context but tracing is disabled' is about vLLM's tracing, --otlp-traces-endpoint, "
        "which otel-llm does not need.)",
        ENV_ENABLE,
        environment.DETAIL,
        detail,
        environment.DETAIL_SENDS[detail],
        destination(),
    )


def log_with_vllm() -> None:
    """Tracing's warnings in vLLM's own log: ``engine_hooks`` and ``otel_llm`` log at WARNING
    through the ``vllm`` logger's handlers. They would go through the root logger, and in vLLM's
    API server a dependency (``model_hosting_container_standards``) sets that to ERROR: the line
    that says what a stop dropped, or that the endpoint is down, was never seen."""
    handlers = logging.getLogger("vllm").handlers
    for name in ("engine_hooks", "otel_llm"):
        lg = logging.getLogger(name)
        if lg.level == logging.NOTSET:
            lg.setLevel(logging.WARNING)
        if handlers and not lg.handlers:
            for h in handlers:
                lg.addHandler(h)
            lg.propagate = False


def register() -> None:
    if not enabled():
        return
    log_with_vllm()
    try:
        from .core import instrument_nixl_worker, instrument_scheduler_class

        instrument_scheduler_class()
        instrument_nixl_worker()  # where this process loads vLLM's NIXL worker (a P/D engine's)
        if environment.env_bool(ENV_FRONTEND, True):
            from . import install_http_middleware, instrument_frontend_classes

            instrument_frontend_classes()
            install_http_middleware()
    except Exception as exc:
        log.warning(
            "otel-llm: vLLM plugin could not install its hooks (%s: %s); vLLM runs untraced", type(exc).__name__, exc
        )
