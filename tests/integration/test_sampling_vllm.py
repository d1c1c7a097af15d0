"""A 10% sample on a real vLLM server (CPU, the tiny Llama, traced through the plugin) and bench's
own client, both configured by the standard OTEL_TRACES_SAMPLER=parentbased_traceidratio with
OTEL_TRACES_SAMPLER_ARG=0.1: the client decides, the server's spans follow its traceparent, and
the request rate and goodput estimated from the collector's store (each sampled request counting
1 / 0.1) are within three standard errors of the truth of the same run, which bench's own
timelines hold for every request, sampled or not."""

from __future__ import annotations

import functools
import json
import math
import time

import pytest
from conftest import run_cli, start_collector, start_vllm_server

from engine_hooks.tiny_model import stop_cpu_server

pytestmark = pytest.mark.slow

P, N = 0.1, 600


def test_rates_and_goodput_from_a_ten_percent_sample(tiny_model, tmp_path):
    from collector.analysis.run_profile import records_of_run

    c, otlp = start_collector(str(tmp_path / "store.db"))
    env = {**otlp, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(P)}
    cfg = c.config
    server, url = start_vllm_server(tiny_model, {"OTEL_LLM_ENABLE": "1", **env})
    truth_file = tmp_path / "truth.jsonl"
    try:
        run_cli(
            "bench",
            "--base-url",
            url,
            "--model",
            tiny_model,
            "--rate",
            "30",
            "--num-requests",
            str(N),
            "--input-tokens",
            "16",
            "--output-tokens",
            "8",
            "--run-id",
            "sampled",
            "--output",
            truth_file,
            env=env,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            counts = records_of_run(cfg.store, "sampled")
            if counts["engine"] and counts == records_of_run(cfg.store, "sampled"):
                time.sleep(1.0)
                if counts == records_of_run(cfg.store, "sampled"):
                    break
            time.sleep(0.5)
    finally:
        stop_cpu_server(server)
        time.sleep(1)
        c.stop()
    counts = records_of_run(cfg.store, "sampled")
    kept = counts["client"]
    # the client kept about 10%, and the server followed it: the same requests at every boundary
    assert abs(kept - N * P) <= 3 * math.sqrt(N * P * (1 - P)), counts
    assert counts["engine"] == counts["server"] == kept

    def analyze(*args, slo=None):
        more = ("--slo", slo) if slo else ()
        return json.loads(run_cli("analyze", *args, *more, "--format", "json").stdout)

    # an SLO at the run's own median client TTFT: about half the requests are good, whatever the machine
    slo = f"ttft={analyze(truth_file)['latency']['ttft']['p50']}"
    analyze = functools.partial(analyze, slo=slo)
    truth = analyze(truth_file)
    assert truth["counts"]["requests"] == N and "sampling" not in truth
    window = f"{truth['window']['start']},{truth['window']['end']}"  # the same window: the run's

    def close(e: float, t: float, n: int, what: str) -> None:
        se = t * math.sqrt((1 - P) / (P * max(n, 1)))  # a count of n sampled at p: sd sqrt(n (1 - p) / p)
        assert abs(e - t) <= 3 * se, (what, e, t, se)

    for boundary in ("client", "engine"):
        est = analyze("--store", cfg.store, "--run", "sampled", "--boundary", boundary, "--window", window)
        assert est["sampling"]["sampled_requests"] == kept
        assert est["sampling"]["smallest_probability"] == pytest.approx(P)
        # the same requests at both boundaries: the client's request rate is the truth for both
        t, n = truth["throughput"]["requests_per_s"], truth["counts"]["completed"]
        close(est["throughput"]["requests_per_s"], t, n, f"{boundary} request rate")
        close(est["throughput"]["output_tokens_per_s"], truth["throughput"]["output_tokens_per_s"], n, "tokens/s")
        if boundary == "client":  # goodput is the client's TTFT against the SLO
            good = truth["goodput"]["good"]
            assert 0 < good < n, "the SLO should split the requests"
            close(est["goodput"]["requests_per_s"], truth["goodput"]["requests_per_s"], good, "client goodput")
