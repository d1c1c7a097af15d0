"""The metric math of docs/metrics/spec.md, pure: the timeline model, per-request metrics,
percentiles, SLOs, windows and their summary (throughput, goodput, attainment), fluidity, which
records a reader keeps, and the timelines file analyze reads. Imports no other part of otel_llm
but its leaves (tests/unit/test_layout.py)."""
