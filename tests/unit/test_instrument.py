"""engine_hooks.instrument: what it accepts, what it says otherwise, and that it never changes
the constructor it wraps (no engine is started here: the classes are vLLM's, the engine a probe)."""

import typing

import pytest

pytest.importorskip("vllm")

import vllm
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.engine.output_processor import OutputProcessor

import engine_hooks
from engine_hooks.api import hooked


class ProbeAsyncLLM(AsyncLLM):
    """AsyncLLM's constructor signature, recording what it is given instead of starting an engine."""

    seen: typing.ClassVar[dict] = {}

    def __init__(self, vllm_config, executor_class, log_stats, usage_context=None, stat_loggers=None, **kw):
        ProbeAsyncLLM.seen = {"config": vllm_config, "executor": executor_class, "log_stats": log_stats, **kw}
        tracing = kw.pop("tracing", False)
        self.output_processor = OutputProcessor(None, log_stats=log_stats, tracing_enabled=tracing)
        self.log_stats = log_stats
        self.logger_manager = object() if log_stats else None  # vLLM's stat loggers
        self.output_handler = kw.pop("running", None)  # AsyncLLM's output loop, if it has started
        self.model_config = None


@pytest.mark.parametrize("thing", [dict, object(), "vllm.LLM", 42])
def test_anything_but_a_vllm_engine_is_refused_with_what_it_takes(thing):
    with pytest.raises(TypeError, match=r"instrument\(\) takes vllm.LLM, AsyncLLM or LLMEngine"):
        engine_hooks.instrument(thing)


def test_options_are_refused_not_dropped():
    with pytest.raises(TypeError):
        engine_hooks.instrument(vllm.LLM, detail="steps")


def test_a_traced_class_is_returned_as_it_is():
    traced = engine_hooks.instrument(vllm.LLM)
    assert traced is not vllm.LLM and issubclass(traced, vllm.LLM) and traced.__name__ == "LLM"
    assert engine_hooks.instrument(traced) is traced and hooked(traced.__init__)
    assert issubclass(engine_hooks.instrument(LLMEngine), LLMEngine)


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (("cfg", "executor", False), {}),  # log_stats by position
        (("cfg", "executor"), {"log_stats": False}),  # by keyword
        (("cfg",), {"executor_class": "executor", "log_stats": False, "log_requests": False}),
    ],
)
def test_stats_are_turned_on_however_log_stats_is_given(args, kwargs):
    traced = engine_hooks.instrument(ProbeAsyncLLM)
    engine = traced(*args, **kwargs)
    assert ProbeAsyncLLM.seen["log_stats"] is True  # the queue / prefill / preemption timestamps need it
    assert ProbeAsyncLLM.seen["config"] == "cfg" and ProbeAsyncLLM.seen["executor"] == "executor"
    assert ProbeAsyncLLM.seen.get("log_requests", False) is False  # everything else passes through unchanged
    assert hooked(engine.output_processor.process_outputs)  # and the front end it built is hooked
    assert engine_hooks.instrument(engine) is engine  # an engine hooked already stays as it is


def _front_end_stats(engine) -> tuple[bool, bool, bool, bool]:
    op = engine.output_processor
    return engine.log_stats, op.log_stats, op.lora_states.log_stats, engine.logger_manager is not None


@pytest.mark.parametrize(
    "kwargs, kept",
    [
        ({"log_stats": False}, False),  # not asked for: off again in the front end (the engine core keeps them)
        ({"log_stats": True}, True),  # asked for: the caller's stat loggers and RequestOutput.metrics stay
        ({"log_stats": False, "stat_loggers": [object]}, True),  # custom stat loggers read them
        ({"log_stats": False, "tracing": True}, True),  # vLLM's own tracing reads them
        ({"log_stats": False, "running": "started"}, True),  # the output loop started: it read log_stats
    ],
)
def test_statistics_the_caller_did_not_ask_for_are_off_in_the_front_end(kwargs, kept):
    engine = engine_hooks.instrument(ProbeAsyncLLM)("cfg", "executor", **kwargs)
    assert ProbeAsyncLLM.seen["log_stats"] is True  # the engine core gets them whichever
    assert _front_end_stats(engine) == (kept,) * 4
    engine.output_handler = None  # the probe has no task for AsyncLLM's shutdown to cancel


def test_the_wrapped_constructor_raises_what_the_class_raises():
    traced = engine_hooks.instrument(ProbeAsyncLLM)
    with pytest.raises(TypeError, match="log_stats"):
        traced("cfg", "executor", False, log_stats=True)  # given twice: the class's own error
    with pytest.raises(TypeError):
        traced("cfg")  # missing arguments
