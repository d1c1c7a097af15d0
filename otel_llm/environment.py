"""Every environment variable the project reads: the names, and the parsing, in one place.

Standard OpenTelemetry variables keep their standard meaning (the SDK and the OTLP exporters
read most of them themselves); the project's own start with ``OTEL_LLM_``. A value that does not
parse is logged with the variable's name and the default is used, like the SDK's own
``_get_*_env`` helpers: a bad environment never stops a process that traces.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("otel_llm")

T = TypeVar("T")

# -- standard OpenTelemetry (https://opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/)
SERVICE_NAME = "OTEL_SERVICE_NAME"
RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"
TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"  # otlp (default) | console | none
OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
METRICS_EXPORTER = "OTEL_METRICS_EXPORTER"  # otlp (default) | none: the tracer's own cost metrics
OTLP_METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
OTLP_METRICS_PROTOCOL = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
BSP_MAX_EXPORT_BATCH_SIZE = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"  # spans per export call (standard: 512)
BSP_EXPORT_TIMEOUT = (
    "OTEL_BSP_EXPORT_TIMEOUT"  # ms to export a batch (standard: 30000): the span process's write and flush bound
)
CAPTURE_MESSAGE_CONTENT = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
# URLs the HTTP server span skips, as OpenTelemetry's ASGI instrumentation reads them: comma-separated
# regular expressions searched in the path (the ASGI one first, then the Python-wide one)
ASGI_EXCLUDED_URLS = "OTEL_PYTHON_ASGI_EXCLUDED_URLS"
EXCLUDED_URLS = "OTEL_PYTHON_EXCLUDED_URLS"
#: what otel-llm's server span skips when neither is set: probes and scrapes, not requests for tokens
DEFAULT_EXCLUDED_URLS = "^/health$,^/ping$,^/metrics$,^/version$,^/load$"

# -- the project's own
TRACES_FILE = "OTEL_LLM_TRACES_FILE"  # a path: OTLP JSON lines instead of OTLP export
ENABLE = "OTEL_LLM_ENABLE"  # trace vLLM through its plugin entry point
FRONTEND = "OTEL_LLM_FRONTEND"  # "0": the plugin leaves this process's vLLM front ends alone
# "1" (set by instrument() while it builds an engine whose caller asked for no statistics): vLLM's
# statistics are on in its engine core only for the scheduler's events; no per-step SchedulerStats
STATS_FOR_TRACING = "OTEL_LLM_STATS_FOR_TRACING"
# "0": an engine process builds and exports its spans on its own span thread, not in a span process
SPAN_PROCESS = "OTEL_LLM_SPAN_PROCESS"
# The engine hooks' span builder is not the SDK's BatchSpanProcessor, so it does not reuse the
# OTEL_BSP_* names whose defaults differ: it wakes every 200 ms (the BSP's default is 5000 ms)
# and its buffer holds raw hook events, not spans.
SCHEDULE_DELAY = "OTEL_LLM_SCHEDULE_DELAY"  # ms between span-building rounds (default 200)
MAX_QUEUE_SIZE = "OTEL_LLM_MAX_QUEUE_SIZE"  # hook events buffered between rounds (default 262144)
#: spans built and waiting for the OTLP exporter's thread (default 8192): a full queue drops and
#: counts, so a slow or hung endpoint never holds the rounds that build them (engine hooks)
EXPORT_QUEUE_SIZE = "OTEL_LLM_EXPORT_QUEUE_SIZE"
#: ms a traced process's exit may spend on its spans, all of it together: the last round, the span
#: processes, the export queue and the tracer's metrics (default 5000); what is left is dropped,
#: counted and said in one line
EXIT_TIMEOUT = "OTEL_LLM_EXIT_TIMEOUT"
STRICT = "OTEL_LLM_STRICT"  # "1": an engine hook that fails raises (tests), instead of being counted
# ms an aborted request's span waits for the tokens its engine still made for it (default 1000)
ABORT_GRACE = "OTEL_LLM_ABORT_GRACE"
#: how much an engine traces: request (the llm.request span alone, its token-event arrays included),
#: phases (default: plus front end, queue, prefill, decode, preemption, stream), steps (plus one
#: llm.engine.step span per engine iteration: batch size, tokens, KV usage)
DETAIL = "OTEL_LLM_DETAIL"


class Detail:
    """The values of ``OTEL_LLM_DETAIL``: how much an engine traces, least first (plain ``str``
    constants, as ``otel_llm.semconv.Boundary``)."""

    REQUEST = "request"  # the llm.request span alone, its token-event arrays included
    PHASES = "phases"  # plus the phase spans: the TTFT's parts (the default)
    STEPS = "steps"  # plus one llm.engine.step per engine iteration


#: each OTEL_LLM_DETAIL level, least first: what an engine sends at it and what it leaves out (the
#: server's start-up log and the report say it)
DETAIL_SENDS = {
    Detail.REQUEST: "llm.request spans with their token events (TTFT, ITL, TPOT, E2E); no phase spans (the TTFT's "
    "parts: queue, prefill, decode, preemption, stream) and no engine-step spans",
    Detail.PHASES: "request and phase spans (queue, prefill, decode, preemption, stream: the TTFT's parts); no "
    "engine-step spans (OTEL_LLM_DETAIL=steps adds one per engine iteration)",
    Detail.STEPS: "request, phase and engine-step spans (one llm.engine.step per engine iteration: batch, tokens, KV)",
}
DETAIL_LEVELS = tuple(DETAIL_SENDS)
DEFAULT_DETAIL = Detail.PHASES  # what the tracing budget is counted at (docs/architecture.md, "The hot path")
PURE_PYTHON = "OTEL_LLM_PURE_PYTHON"  # no C accelerator: the collector parses with protobuf, the hooks scan in Python
COLLECTOR_PREFIX = "OTEL_LLM_COLLECTOR_"  # + an `otel-llm collector` option, e.g. _STORE, _MAX_TRACES
BENCH_PREFIX = "OTEL_LLM_BENCH_"  # + an `otel-llm bench` option, e.g. _BASE_URL, _RATE
OPENAI_API_KEY = "OPENAI_API_KEY"  # bench's --api-key default

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def raw(name: str) -> str | None:
    """The variable as set, None when unset or blank."""
    v = os.environ.get(name)
    return v if v is not None and v.strip() else None


def parsed(name: str, default: T, convert: Callable[[str], T], expected: str = "") -> T:
    """``convert(value)`` of the variable, else ``default``: unset, or (logged) not parseable."""
    v = raw(name)
    if v is None:
        return default
    try:
        return convert(v.strip())
    except (ValueError, TypeError) as exc:
        why = expected or str(exc)
        log.warning("otel-llm: ignoring %s=%r (%s); using the default %r", name, v, why, default)
        return default


def env_str(name: str, default: str | None = None) -> str | None:
    return parsed(name, default, str)


def env_bool(name: str, default: bool = False) -> bool:
    def convert(v: str) -> bool:
        low = v.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError("expected true or false")

    return parsed(name, default, convert)


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    def convert(v: str) -> int:
        n = int(v)
        if minimum is not None and n < minimum:
            raise ValueError(f"expected an integer >= {minimum}")
        return n

    return parsed(name, default, convert, "" if minimum is None else f"expected an integer >= {minimum}")


def detail_level(default: str = DEFAULT_DETAIL) -> str:
    """``OTEL_LLM_DETAIL``: one of :data:`DETAIL_LEVELS` (anything else is logged, the default used)."""

    def convert(v: str) -> str:
        low = v.strip().lower()
        if low not in DETAIL_LEVELS:
            raise ValueError(f"expected one of {', '.join(DETAIL_LEVELS)}")
        return low

    return parsed(DETAIL, default, convert)


def excluded_urls():
    """The compiled pattern of paths the HTTP server span skips (see ASGI_EXCLUDED_URLS)."""
    import re

    text = raw(ASGI_EXCLUDED_URLS)
    if text is None:
        text = raw(EXCLUDED_URLS)
    if text is None:
        text = DEFAULT_EXCLUDED_URLS
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        return re.compile("|".join(f"(?:{p})" for p in parts)) if parts else None
    except re.error:
        return re.compile("|".join(f"(?:{p})" for p in DEFAULT_EXCLUDED_URLS.split(",")))


def _option_variable(prefix: str, option: str) -> str:
    return prefix + option.lstrip("-").upper().replace("-", "_")


def collector_variable(option: str) -> str:
    """The variable of an ``otel-llm collector`` option: ``--max-traces`` ->
    ``OTEL_LLM_COLLECTOR_MAX_TRACES``."""
    return _option_variable(COLLECTOR_PREFIX, option)


def bench_variable(option: str) -> str:
    """The variable of an ``otel-llm bench`` option: ``--base-url`` -> ``OTEL_LLM_BENCH_BASE_URL``."""
    return _option_variable(BENCH_PREFIX, option)
