"""Benchmark: CPU per traced request on the vLLM front end's span thread, stage by stage.

A batch of requests run through the same code the front end's pipeline runs, on real vLLM
``EngineCoreOutput`` objects: every request arrives, gets one token per step for ``--tokens``
steps (its first output with the engine core's QUEUED and SCHEDULED events, its last with a
finish reason), and its spans are built and encoded. Prints microseconds of thread CPU per
request for each stage (the least of ``--repeat`` runs, as timeit reports: this machine's neighbours only ever add).

* unpack: the steps' outputs into token events (``engine_hooks.vllm.frontend.expand_outputs``);
* build: the request's spans at the phases level (``SpanFactory.request_spans``);
* protobuf / json: encoding them for OTLP (gRPC or HTTP) / for ``OTEL_LLM_TRACES_FILE``.

Run: ``.venv/bin/python benchmarks/frontend_cost.py [--requests 128] [--tokens 256] [--repeat 5]``
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

if __name__ == "__main__":  # run as the benchmark; never on import: a test that imports its stand-ins keeps
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its process's environment for the servers it starts
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from engine_hooks.hot_path import hook_events
from engine_hooks.spans.span_factory import SpanFactory
from engine_hooks.spans.tracker import RequestTracker
from engine_hooks.vllm.frontend import expand_outputs, output_scanner
from otel_llm import semconv as sc
from otel_llm.clock import monotonic_ns
from otel_llm.otlp import otlp_encode
from otel_llm.otlp.tracing import make_resource


class StandInRequest:
    """What the arrival hook reads of vLLM's ``EngineCoreRequest``: the internal id is the
    external one with a suffix, as vLLM's input processor makes it."""

    def __init__(self, external_id: str, prompt_tokens: int = 32, suffix: str = "-x1"):
        self.request_id = external_id + suffix
        self.external_req_id = external_id
        self.arrival_time = time.time()
        self.prompt_token_ids = [1] * prompt_tokens
        self.trace_headers = None


class StandInOutputProcessor:
    """vLLM's ``OutputProcessor`` as the front end's hooks wrap it
    (``engine_hooks.vllm.frontend.instrument_output_processor``): its own work left out."""

    def add_request(self, request, prompt=None, parent_req=None, request_index=0, queue=None):
        return None

    def process_outputs(self, engine_core_outputs, engine_core_timestamp=None, iteration_stats=None):
        return None

    def abort_requests(self, request_ids, internal=False):
        return []


def step_outputs(n: int, steps: int) -> list[list]:
    """vLLM's ``EngineCoreOutput`` lists of ``n`` requests over ``steps`` one-token steps: the
    first with the engine core's QUEUED and SCHEDULED events, the last with a finish reason."""
    from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, FinishReason

    now = time.monotonic()
    out = []
    for t in range(steps):
        outputs = []
        for i in range(n):
            ev = None
            if t == 0:
                ev = [
                    EngineCoreEvent(EngineCoreEventType.QUEUED, now),
                    EngineCoreEvent(EngineCoreEventType.SCHEDULED, now + 1e-4),
                ]
            fin = FinishReason.LENGTH if t == steps - 1 else None
            outputs.append(EngineCoreOutput(f"r{i}", [5], events=ev, finish_reason=fin))
        out.append(outputs)
    return out


def events(n: int, steps: int, outputs: list[list] | None = None) -> list[tuple]:
    """The recorder's events for ``n`` requests of ``steps`` one-token steps, as vLLM's hooks record
    them (each step's outputs scanned as the engine's thread does, :func:`output_scanner`)."""
    scan = output_scanner()
    m0, now = monotonic_ns(), time.monotonic()
    out = [hook_events.arrival(m0, f"r{i}", None, 32, None, {sc.REQUEST_ID: f"r{i}"}) for i in range(n)]
    last = None
    for t, step in enumerate(outputs or step_outputs(n, steps)):
        ids, counts, rare = scan(step, last)
        last = ids
        step_mono = m0 + (t + 1) * 3_000_000
        out.append(hook_events.raw(step_mono, expand_outputs, (now + (t + 1) * 0.003, ids, counts, rare)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    kw = {"int_arrays": True} if "int_arrays" in inspect.signature(SpanFactory).parameters else {}
    stages: dict[str, list[float]] = {"unpack": [], "build": [], "protobuf": [], "json": []}
    n = a.requests
    for _ in range(a.repeat):
        evs = events(n, a.tokens)
        tracker = RequestTracker()
        factory = SpanFactory(make_resource("bench"), "engine", "vllm", "tiny", "phases", **kw)
        c = [time.thread_time_ns()]
        tracker.feed(evs)
        done, _ = tracker.take()
        c.append(time.thread_time_ns())
        spans = [s for r in done for s in factory.request_spans(r)]
        c.append(time.thread_time_ns())
        otlp_encode.encode_spans_bytes(spans)  # what the OTLP exporters send
        c.append(time.thread_time_ns())
        otlp_encode.spans_to_json(spans)
        c.append(time.thread_time_ns())
        assert len(done) == n
        for k, name in enumerate(stages):
            stages[name].append((c[k + 1] - c[k]) / n / 1000)
    med = {k: min(v) for k, v in stages.items()}
    print(f"{n} requests x {a.tokens} one-token steps, {len(spans) // n} spans each, least of {a.repeat} runs")
    print("us of CPU per request: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    print(
        f"per request, OTLP (unpack + build + protobuf): {med['unpack'] + med['build'] + med['protobuf']:.1f} us; "
        f"file (unpack + build + json): {med['unpack'] + med['build'] + med['json']:.1f} us; "
        f"unpacking {med['unpack'] / a.tokens * 1000:.0f} ns per request per step"
    )


if __name__ == "__main__":
    main()
