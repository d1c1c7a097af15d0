"""Building spans, off the engine's thread: hook events -> finished requests and steps
(:mod:`.tracker`) -> OpenTelemetry spans (:mod:`.span_factory`) -> an exporter
(:mod:`.delivery`), and what tracing costs the process (:mod:`.self_metrics`). Imports the hot
path only."""
