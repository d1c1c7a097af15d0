"""The wire: the fast OTLP encoder, OTLP/JSON, OTLP JSON-lines trace files and their spans as plain
records, exporters from the standard OTEL_* variables, the client's tracer provider, and the one
module that touches the SDK's internals."""
