"""The load generator and what runs on it: the ``otel-llm bench`` command (``command``), sweeps
and the capacity search (pure: ``capacity``; their points: ``bench_sweep``), recorded workloads
to replay (``replay``)."""
