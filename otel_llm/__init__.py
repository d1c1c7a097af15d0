"""otel-llm: OpenTelemetry tracing and exact latency metrics for LLM inference engines.

The core package: semantic conventions, the timeline model, the metric math of docs/metrics/spec.md,
client-side instrumentation and the ``otel-llm`` command.
"""

from .metrics.percentiles import percentiles
from .metrics.request_math import RequestMetrics, request_metrics, single_request_metrics
from .metrics.slo import SLO
from .metrics.summary import Summary, summarize
from .metrics.timeline import Timeline, TimelineBatch
from .metrics.window import Window

__version__ = "0.1.0"
__all__ = [
    "SLO",
    "RequestMetrics",
    "Summary",
    "Timeline",
    "TimelineBatch",
    "Window",
    "__version__",
    "percentiles",
    "request_metrics",
    "single_request_metrics",
    "summarize",
]
