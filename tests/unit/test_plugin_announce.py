"""The vLLM plugin's one line saying tracing is on is seen whatever vLLM's log level (#46 item 9):
at INFO where vLLM logs INFO, at WARNING where it does not (the demo's VLLM_LOGGING_LEVEL=WARNING),
and it explains vLLM's own 'tracing is disabled' warning."""

from __future__ import annotations

import logging

import pytest

from engine_hooks.vllm import plugin


@pytest.mark.parametrize("vllm_level, said_at", [(logging.INFO, logging.INFO), (logging.WARNING, logging.WARNING)])
def test_the_announcement_is_seen_at_any_vllm_log_level(monkeypatch, caplog, vllm_level, said_at):
    monkeypatch.setattr(plugin, "_announced", False)
    logger = logging.getLogger("vllm.otel_llm")
    monkeypatch.setattr(logger, "level", vllm_level)
    with caplog.at_level(logging.DEBUG, logger="vllm.otel_llm"):
        logger.setLevel(vllm_level)
        plugin.announce()
        plugin.announce()  # once
    (rec,) = [r for r in caplog.records if "otel-llm: tracing this vLLM server" in r.getMessage()]
    assert rec.levelno == said_at
    assert "tracing is disabled" in rec.getMessage() and "--otlp-traces-endpoint" in rec.getMessage()
