"""Tracing for vLLM (v1 engine).

``instrument(vllm.LLM)`` / ``instrument(AsyncLLM)`` return subclasses with the same constructor
and API whose engines are traced: request spans from the front end (``frontend.py``) and
per-iteration step spans from inside the engine-core process (``core.py``, loaded there by
vLLM's plugin entry point). ``instrument(engine)`` hooks an engine already built, with less
detail (it says which, once). ``vllm serve`` is traced through the plugin with
``OTEL_LLM_ENABLE=1`` (``plugin.py``).

vLLM's statistics (``disable_log_stats=False``; the server's default) carry the engine core's own
QUEUED / SCHEDULED / PREEMPTED timestamps and its account of the prompt's cached tokens;
``instrument`` turns them on in the engine core. Where the caller did not ask for statistics, it
turns them off again in the front end (:func:`_front_end_stats_off`): there they would only feed
vLLM's stat loggers (its periodic log lines, its Prometheus metrics), which cost the front end's
thread more CPU than all of otel-llm's tracing does, and change what the caller sees
(``RequestOutput.metrics``, ``get_metrics()``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from typing import Any

from otel_llm import environment

from .. import asgi
from ..api import EngineHooks, hooked, mark_hooked
from .disagg import engine_connector
from .frontend import capture_trace_headers, instrument_output_processor
from .plugin import ENV_ENABLE, ENV_FRONTEND, announce

log = logging.getLogger("engine_hooks")
_hooks: EngineHooks | None = None
_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def frontend_hooks() -> EngineHooks:
    global _hooks
    if _hooks is None:
        _hooks = EngineHooks(engine="vllm", service_name="vllm")
    return _hooks


# the HTTP server spans of vLLM's API server join its front end's pipeline
asgi.serve_engine(lambda: frontend_hooks().pipeline.recorder)


def _model_name(engine: Any) -> str | None:
    mc = getattr(engine, "model_config", None)
    if mc is None:
        return None
    name = getattr(mc, "served_model_name", None) or getattr(mc, "model", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name) if name else None


def attach(engine: Any) -> bool:
    """Hook the front end of one ``LLMEngine`` / ``AsyncLLM`` (idempotent)."""
    op = getattr(engine, "output_processor", None)
    if op is None:
        raise TypeError(f"{type(engine).__name__} has no output_processor: not a vLLM v1 engine")
    hooks = frontend_hooks()
    done = instrument_output_processor(op, hooks, _model_name(engine), engine_connector(engine))
    capture_trace_headers(engine)
    # the pipeline, and its span process, start with the engine, not with its first request: a
    # span process takes a second or more to import, and the first request's spans came that much
    # after its client's (a client exporting every 100 ms had its first request released unpaired)
    hooks.pipeline.start()
    if done and not getattr(engine, "log_stats", True):
        _warn_once(
            "log_stats",
            "otel-llm: this vLLM engine runs with stats logging off (disable_log_stats=True): "
            "requests get llm.request, llm.stream and token events, but no queue, prefill, decode or "
            "preemption spans. Build it with disable_log_stats=False (instrument(vllm.LLM) does).",
        )
    return done


@contextlib.contextmanager
def _core_plugin_env(stats_for_tracing: bool = False):
    """While an engine is built: its engine-core process loads the plugin (step spans), and the
    plugin leaves front ends other than this engine's alone. ``stats_for_tracing``: vLLM's
    statistics are on only for the hooks' events, so its engine core makes no per-step
    ``SchedulerStats`` (``core.events_only_stats``)."""
    keys = (ENV_ENABLE, ENV_FRONTEND, environment.STATS_FOR_TRACING)
    saved = {k: os.environ.get(k) for k in keys}
    os.environ[ENV_ENABLE] = "1"
    os.environ[ENV_FRONTEND] = "0"
    if stats_for_tracing:
        os.environ[environment.STATS_FOR_TRACING] = "1"
    else:
        os.environ.pop(environment.STATS_FOR_TRACING, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _engine_of(obj: Any) -> Any:
    return getattr(obj, "llm_engine", None) or obj


def _vllm_classes() -> tuple[type, type, type]:
    """(vllm.LLM, AsyncLLM, LLMEngine): what :func:`instrument` takes."""
    from vllm.entrypoints.llm import LLM
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine

    return LLM, AsyncLLM, LLMEngine


def instrument(target: Any) -> Any:
    """Trace a vLLM engine: ``vllm.LLM``, ``AsyncLLM`` or ``LLMEngine`` (or a subclass) gives a
    traced subclass with the same constructor; an engine already built is hooked in place and
    returned (with less detail: it says which, once). Anything else is a TypeError; a class or
    engine already traced is returned as it is."""
    llm, async_llm, llm_engine = _vllm_classes()
    accepted = "vllm.LLM, AsyncLLM or LLMEngine (a class, or an engine built from one)"
    if isinstance(target, type):
        if not issubclass(target, (llm, async_llm, llm_engine)):
            raise TypeError(
                f"instrument() takes {accepted}, not the class {target.__qualname__}; "
                "trace another engine with engine_hooks.EngineHooks (docs/engine_hooks.md)"
            )
        return target if hooked(target.__init__) else _instrument_class(target, issubclass(target, llm))
    if not isinstance(target, (llm, async_llm, llm_engine)):
        raise TypeError(f"instrument() takes {accepted}, not a {type(target).__qualname__}")
    engine = _engine_of(target)
    if attach(engine):
        _warn_once(
            "instance",
            "otel-llm: instrument() was given an engine that is already running: its engine-core "
            "process started without the otel-llm hooks, so there are no llm.engine.step spans (batch size, "
            "prefill/decode tokens, KV usage). Use instrument(%s) before building it, or set OTEL_LLM_ENABLE=1, "
            "for those.",
            type(target).__name__,
        )
    return target


def _front_end_stats_off(engine: Any) -> None:
    """Turn vLLM's statistics off in the front end of an engine built with them on (its engine
    core keeps them: the events the hooks read come from there). Not where something in the front
    end reads them: vLLM's own tracing, custom stat loggers, or an AsyncLLM whose output loop has
    started (it read ``log_stats`` when it did)."""
    op = getattr(engine, "output_processor", None)
    if op is None or getattr(op, "tracing_enabled", False) or getattr(engine, "output_handler", None) is not None:
        return
    engine.log_stats = op.log_stats = False
    lora = getattr(op, "lora_states", None)
    if lora is not None:
        lora.log_stats = False
    if hasattr(engine, "logger_manager"):
        engine.logger_manager = None


def _own_tracing_asked(arguments: dict) -> bool:
    """Whether the constructor's arguments turn vLLM's own tracing on (``otlp_traces_endpoint``,
    given directly, through ``**kwargs`` or in a ``vllm_config``): it reads vLLM's statistics."""
    for name, value in arguments.items():
        if name == "otlp_traces_endpoint" and value:
            return True
        if isinstance(value, dict) and value.get("otlp_traces_endpoint"):
            return True
        obs = getattr(value, "observability_config", None)
        if obs is not None and getattr(obs, "otlp_traces_endpoint", None):
            return True
    return False


def _instrument_class(cls: type, is_llm: bool) -> type:
    """A subclass whose constructor turns vLLM's statistics on (``disable_log_stats=False`` for
    ``vllm.LLM``, ``log_stats=True`` for the engines, given by keyword or by position), lets the
    engine-core process load the step hooks, then hooks the front end it built. Statistics the
    caller did not ask for (nor custom stat loggers) are off again in that front end."""
    sig = inspect.signature(cls.__init__)

    def __init__(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)  # the caller's TypeError, as the class would raise it
        if is_llm:
            if "disable_log_stats" in sig.parameters:
                asked = bound.arguments.get("disable_log_stats") is False
                bound.arguments["disable_log_stats"] = False
            else:  # vllm.LLM takes it through **kwargs (EngineArgs)
                kwargs_param = next(p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD)
                extra = bound.arguments.setdefault(kwargs_param.name, {})
                asked = extra.get("disable_log_stats") is False
                extra["disable_log_stats"] = False
        else:
            asked = bound.arguments.get("log_stats") is True or bool(bound.arguments.get("stat_loggers"))
            bound.arguments["log_stats"] = True
        with _core_plugin_env(stats_for_tracing=not asked and not _own_tracing_asked(bound.arguments)):
            cls.__init__(*bound.args, **bound.kwargs)
        engine = _engine_of(self)
        attach(engine)
        if not asked:
            _front_end_stats_off(engine)

    __init__ = mark_hooked(functools.wraps(cls.__init__)(__init__))
    traced = type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": cls.__doc__, "__module__": cls.__module__})
    traced.__qualname__ = cls.__qualname__
    return traced


def instrument_frontend_classes() -> None:
    """Plugin mode: hook every LLMEngine / AsyncLLM built in this process from now on."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine

    for cls in (AsyncLLM, LLMEngine):
        init = cls.__init__
        if hooked(init):
            continue

        def make(init):
            @functools.wraps(init)
            def __init__(self, *args, **kwargs):
                init(self, *args, **kwargs)
                try:
                    attach(self)
                    announce()
                except Exception as exc:
                    _warn_once("attach", "otel-llm: could not hook the vLLM front end (%s); untraced", exc)

            return mark_hooked(__init__)

        cls.__init__ = make(init)


def install_http_middleware() -> bool:
    """Plugin mode: vLLM's API server builds its app with :class:`engine_hooks.asgi.TracingMiddleware`
    outermost (the server boundary: one span per HTTP request, the parent of ``llm.request``).
    Returns False where vLLM has no such hook point (then ``--middleware`` still works)."""
    try:
        import vllm.entrypoints.launchers.app as launcher
    except ImportError:
        return False
    init = getattr(launcher, "init_entrypoints_middleware", None)
    if init is None or hooked(init):
        return init is not None
    asgi.instrument_uvicorn()  # before uvicorn reads the first request

    @functools.wraps(init)
    def init_entrypoints_middleware(args, app, *rest, **kwargs):
        out = init(args, app, *rest, **kwargs)
        try:
            app.add_middleware(asgi.TracingMiddleware)  # added last: outermost, closest to the wire
        except Exception as exc:
            _warn_once("http", "otel-llm: could not add the HTTP server span (%s); the server boundary is off", exc)
        return out

    launcher.init_entrypoints_middleware = mark_hooked(init_entrypoints_middleware)
    return True
