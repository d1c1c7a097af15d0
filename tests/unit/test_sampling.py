"""OTEL_TRACES_SAMPLER on the engine hooks, the client and the collector (docs/metrics/spec.md,
"Sampling"): which requests an engine keeps (the SDK's own rule), the probability each kept one
carries, and rates and goodput estimated from a sample within their sampling error of the truth.
The same against a real vLLM server and bench's own client: tests/integration/test_sampling_vllm.py."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from conftest import ROOT

from collector.analysis.offline import read_trace_file as derive_trace_file
from engine_hooks import TracingPipeline
from otel_llm import semconv as sc
from otel_llm.metrics.summary import summarize
from otel_llm.metrics.timeline import Timeline, TimelineBatch
from otel_llm.otlp.export import FileSpanExporter
from otel_llm.otlp.span_records import read_trace_file

sys.path.insert(0, str(ROOT / "examples"))
import toy_engine

N = 400


def run_toy(path, traceparents=None):
    """N requests through the toy engine, traced into ``path`` with the sampler the environment says."""
    pipeline = TracingPipeline(FileSpanExporter(str(path)), service_name="toy", interval_s=60, detail="request")
    toy_engine.hooks.use(pipeline)
    eng = toy_engine.ToyEngine(kv_capacity=100_000, max_batch=64, step_time_s=0)
    for i in range(N):
        tp = traceparents[i] if traceparents else None
        eng.add_request(toy_engine.Request(f"r{i}", prompt_len=8, max_tokens=4, traceparent=tp))
    done = eng.run()
    pipeline.shutdown()
    return done, pipeline


def test_a_ratio_sampler_keeps_what_the_sdk_would_and_says_with_what_probability(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    done, pipeline = run_toy(tmp_path / "spans.jsonl")
    assert len(done) == N  # the engine's work is the same, sampled or not
    spans = [s for s in read_trace_file(tmp_path / "spans.jsonl") if s.name == sc.SPAN_REQUEST]
    bound = round(0.25 * 2**64)  # the SDK's TraceIdRatioBased: the trace id's low 64 bits below rate x 2^64
    assert all(int(s.trace_id, 16) & (2**64 - 1) < bound for s in spans)
    assert all(s.attributes[sc.SAMPLING_PROBABILITY] == 0.25 for s in spans)
    assert pipeline.counters.requests_unsampled == N - len(spans)
    assert abs(len(spans) - N * 0.25) <= 3 * math.sqrt(N * 0.25 * 0.75)
    # the collector weighs each by 4: the request count estimated within its sampling error
    records, _ = derive_trace_file(str(tmp_path / "spans.jsonl"))
    assert set(records.sample_weight.tolist()) == {4.0}
    s = summarize(records.timelines())
    assert s.sampling["sampled_requests"] == len(spans) and s.sampling["estimated_requests"] == 4.0 * len(spans)
    assert abs(s.sampling["estimated_requests"] - N) <= 3 * math.sqrt(N * 0.75 / 0.25)


def test_a_parent_based_sampler_follows_the_callers_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.000001")  # its own roots: almost never
    tps = [f"00-{i + 1:032x}-{i + 1:016x}-{'01' if i % 3 == 0 else '00'}" for i in range(N)]
    run_toy(tmp_path / "spans.jsonl", tps)
    spans = [s for s in read_trace_file(tmp_path / "spans.jsonl") if s.name == sc.SPAN_REQUEST]
    assert sorted(int(s.trace_id, 16) - 1 for s in spans) == [i for i in range(N) if i % 3 == 0]
    assert all(sc.SAMPLING_PROBABILITY not in s.attributes for s in spans)  # the caller decided, not the engine


def test_weighted_rates_and_goodput():
    """Two sampled requests, one kept at p = 0.5 and one at 0.25, in a 1 s window: 6 requests/s
    estimated, goodput counting only the good one (weight 4), the counts the sample's own."""
    tls = [
        Timeline("a", 0.0, 1.0, "ok", ((0.1, 1), (0.2, 1))),
        Timeline("b", 0.0, 1.0, "ok", ((0.5, 1), (0.6, 1))),
    ]
    b = TimelineBatch.from_timelines(tls)
    plain = summarize(b)
    b.weight = np.array([2.0, 4.0])
    from otel_llm.metrics.slo import SLO

    s = summarize(b, slo=SLO(ttft=0.3))
    assert plain.requests_per_s == 2.0 and s.requests_per_s == 6.0
    assert s.output_tokens_per_s == 12.0 and s.output_tokens_in_window == 12.0
    assert s.goodput.good == 1 and s.goodput.requests_per_s == 2.0 and s.goodput.attainment == pytest.approx(1 / 3)
    assert s.counts.requests == 2 and s.latency["ttft"].n == 2
    assert s.to_json()["sampling"]["estimated_requests"] == 6.0


def test_the_collector_counts_each_request_for_its_weight(make_collector):
    """Spans kept at p = 0.25 count 4 each in llm_requests_total and the SLO counter; the latency
    histograms hold the sample."""
    import urllib.request

    from support.otlp_helpers import Req, grpc_exporter, send, wait_for

    from otel_llm.metrics.slo import SLO

    c = make_collector(slos={"default": SLO(ttft=1.0)})
    send(
        grpc_exporter(c.receivers[0].port),
        [Req(f"s{i}", client_attrs={sc.SAMPLING_PROBABILITY: 0.25}) for i in range(3)]
        # claims no sampler makes: one span counting for 1e300 requests, a probability over 1, a string
        + [Req(f"h{i}", client_attrs={sc.SAMPLING_PROBABILITY: v}) for i, v in enumerate((1e-300, 2.0, "0.5"))],
    )
    wait_for(lambda: c.records_derived >= 12, what="derivation")
    c.store_writer.drain()  # derived records reach the store through its writer process
    hostile = [r for r in c.store.records() if r.request_id.startswith("h")]
    assert len(hostile) == 6 and {r.sample_weight for r in hostile} == {1.0}  # not taken: weight 1
    c = make_collector(slos={"default": SLO(ttft=1.0)})
    send(
        grpc_exporter(c.receivers[0].port),
        [Req(f"s{i}", client_attrs={sc.SAMPLING_PROBABILITY: 0.25}) for i in range(3)],
    )
    wait_for(lambda: c.records_derived >= 6, what="derivation")
    c.store_writer.drain()
    recs = c.store.records()
    assert {(r.boundary, r.sample_weight) for r in recs} == {
        ("client", 4.0),
        ("engine", 4.0),
    }  # the engine: its client's
    host, port = c.prometheus.address
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics").read().decode()
    assert 'llm_requests_total{boundary="client",model="tiny",status="ok"} 12.0' in text
    assert 'llm_requests_total{boundary="engine",model="tiny",status="ok"} 12.0' in text
    assert 'llm_slo_good_requests_total{boundary="client",model="tiny",slo="default"} 12.0' in text
    assert 'gen_ai_server_time_to_first_token_seconds_count{boundary="client",model="tiny"} 3' in text
