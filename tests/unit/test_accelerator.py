"""One policy for the three C accelerators (otel_llm.accelerator): each runs where it was built
unless OTEL_LLM_PURE_PYTHON is set true, read when the question is asked, the same for all three."""

from __future__ import annotations

import pytest

from collector.receivers import decode
from engine_hooks.hot_path import batch_scan
from otel_llm import accelerator
from otel_llm.otlp import otlp_encode

BUILT = {
    "engine_hooks.hot_path._hotpath": batch_scan._hotpath,
    "collector.receivers._otlp_walk": decode._otlp_walk,
    "otel_llm.otlp._int_text": otlp_encode._int_text,
}


@pytest.mark.parametrize("value", [None, "0", "false", "", "1", "true", "yes"])
def test_every_accelerator_follows_the_one_variable_when_asked(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("OTEL_LLM_PURE_PYTHON", raising=False)
    else:
        monkeypatch.setenv("OTEL_LLM_PURE_PYTHON", value)
    off = value in ("1", "true", "yes")
    assert accelerator.pure_python() is off
    for name, module in BUILT.items():
        assert accelerator.on(module) is (module is not None and not off), name
        assert accelerator.active(module) is (None if off else module), name
    assert batch_scan.accelerated() is accelerator.on(batch_scan._hotpath)
    assert decode.accelerated() is accelerator.on(decode._otlp_walk)


def test_a_module_that_did_not_build_is_never_on(monkeypatch):
    monkeypatch.delenv("OTEL_LLM_PURE_PYTHON", raising=False)
    assert accelerator.on(None) is False and accelerator.active(None) is None


def test_the_json_writer_switches_when_the_variable_changes_after_import(monkeypatch):
    """otlp_encode decided once at import before: a process that set the variable later kept C.
    The same span's text either way (the writers agree), and the Python writer is the one used."""
    import numpy as np
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, TraceFlags

    if otlp_encode._int_text is None:
        pytest.skip("the C accelerator is not built here")
    ctx = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, False, TraceFlags(1))
    s = ReadableSpan(name="s", context=ctx, attributes={"a": np.arange(5, dtype=np.int64)}, start_time=1, end_time=2)
    calls = []
    real = otlp_encode._int_text

    class Spy:
        @staticmethod
        def values_json(v):
            calls.append(len(v))
            return real.values_json(v)

    monkeypatch.setattr(otlp_encode, "_int_text", Spy)
    monkeypatch.delenv("OTEL_LLM_PURE_PYTHON", raising=False)
    fast = otlp_encode.spans_to_json([s])
    assert calls == [5]
    monkeypatch.setenv("OTEL_LLM_PURE_PYTHON", "1")
    assert otlp_encode.spans_to_json([s]) == fast and calls == [5]
