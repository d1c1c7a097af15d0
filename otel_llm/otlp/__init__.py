"""The wire: the fast OTLP encoder, OTLP/JSON, OTLP JSON-lines trace files, exporters from the
standard OTEL_* variables, the client's tracer provider, and the one module that touches the SDK's
internals."""
