"""otel-llm bench against the fake streaming server: load modes, conditions, output, Ctrl-C."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, run_cli

from otel_llm.bench.load import LengthDist, LoadSpec, arrival_offsets
from otel_llm.otlp.span_records import read_trace_file


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("32").sample(rng) == 32
    u = LengthDist.parse("uniform:10:20")
    xs = [u.sample(rng) for _ in range(500)]
    assert min(xs) == 10 and max(xs) == 20
    assert LengthDist.parse("normal:100:5").sample(rng) > 50
    for bad in ("0", "uniform:5", "uniform:9:3", "zipf:1:2", "x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


@pytest.mark.parametrize("arrival", ["poisson", "constant", "gamma"])
def test_arrival_processes_hit_the_rate(arrival):
    spec = LoadSpec(rate=50.0, arrival=arrival, burstiness=0.5)
    off = arrival_offsets(spec, 20000, np.random.default_rng(1))
    assert off[0] == 0 and (np.diff(off) >= 0).all()
    assert (len(off) - 1) / off[-1] == pytest.approx(50.0, rel=0.05)
    cv = np.std(np.diff(off)) / np.mean(np.diff(off))
    assert cv == pytest.approx({"poisson": 1.0, "constant": 0.0, "gamma": 2**0.5}[arrival], abs=0.06)


def test_open_loop_run(server, tmp_path):
    out = tmp_path / "timelines.jsonl"
    traces = tmp_path / "spans.jsonl"
    proc = run_cli(
        "bench",
        "--base-url",
        server.base_url,
        "--model",
        "m",
        "--rate",
        "40",
        "--num-requests",
        "20",
        "--input-tokens",
        "uniform:5:9",
        "--output-tokens",
        "6",
        "--warmup",
        "3",
        "--seed",
        "7",
        "--output",
        out,
        "--format",
        "json",
        env={"OTEL_LLM_TRACES_FILE": str(traces)},
    )
    summary = json.loads(proc.stdout)
    c = summary["conditions"]
    assert c["load_mode"] == "open" and c["arrival_process"] == "poisson" and c["nominal_rate_per_s"] == 40
    assert c["requests_sent"] == 20 and c["warmup_requests_excluded"] == 3 and c["statuses"]["ok"] == 20
    assert c["achieved_arrival_rate_per_s"] > 5 and "schedule_delay_s" in c
    assert c["input_tokens"] == "uniform[5, 9]" and c["output_tokens"] == "6"
    assert summary["counts"]["completed"] == 20 and summary["latency"]["ttft"]["n"] == 20
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 20 and all(sum(k for _, k in r["events"]) == 6 for r in rows)
    assert all(r["intended"] <= r["submit"] + 1e-3 for r in rows)
    # the output file is valid analyze input
    again = json.loads(run_cli("analyze", out, "--format", "json").stdout)
    assert again["counts"]["completed"] == 20
    # prompts were token ids of the drawn lengths, ignore_eos set
    bodies = [r["body"] for r in server.requests]
    assert len(bodies) == 23 and all(5 <= len(b["prompt"]) <= 9 and b["ignore_eos"] for b in bodies)
    all_spans = read_trace_file(traces)
    (run_span,) = [s for s in all_spans if s.name == "llm.bench.run"]
    assert run_span.attributes["llm.bench.requests_sent"] == 20
    assert run_span.attributes["llm.bench.achieved_arrival_rate_per_s"] == pytest.approx(
        c["achieved_arrival_rate_per_s"]
    )
    assert "llm.bench.schedule_delay_s.p99" in run_span.attributes
    spans = [s for s in all_spans if s.name == "llm.client.request"]
    assert len(spans) == 23
    assert spans[0].resource["llm.bench.load_mode"] == "open" and spans[0].resource["llm.bench.model"] == "m"
    assert sum(1 for s in spans if s.attributes.get("llm.bench.warmup")) == 3


def test_closed_loop_run(server):
    proc = run_cli(
        "bench",
        "--base-url",
        server.base_url,
        "--model",
        "m",
        "--concurrency",
        "3",
        "--num-requests",
        "12",
        "--output-tokens",
        "4",
    )
    assert "load_mode: closed" in proc.stdout and "concurrency: 3" in proc.stdout
    assert "completed 12" in proc.stdout and "not the same load" in proc.stdout


def interrupted_bench(server, args: list[str], ready) -> tuple[int, str, str]:
    """Run bench against ``server``, send SIGINT once ``ready()`` holds (then half a second more),
    and return (exit code, stdout, stderr)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "otel_llm", "bench", "--base-url", server.base_url, "--model", "m", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**__import__("os").environ, "OTEL_TRACES_EXPORTER": "none"},
    )
    t0 = time.monotonic()
    while not ready() and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    return p.returncode, out, err


def test_ctrl_c_cancels_in_flight_and_still_summarises(server, tmp_path):
    args = ["--concurrency", "4", "--num-requests", "50", "--output-tokens", "200"]
    code, out, err = interrupted_bench(server, args, lambda: len(server.requests) >= 4)  # the load is running
    assert code == 130, err
    assert "interrupted: True" in out
    cancelled = int(out.split("cancelled ")[1].split(",")[0])
    assert cancelled >= 1


def test_bad_flags():
    proc = run_cli("bench", "--base-url", "http://x/v1", "--model", "m", "--rate", "0", check=False)
    assert proc.returncode == 2 and "--rate must be > 0" in proc.stderr
    proc = run_cli("bench", "--base-url", "http://x/v1", "--model", "m", check=False)
    assert proc.returncode == 2 and "--rate" in proc.stderr


BENCH = ["bench", "--base-url", "http://127.0.0.1:9/v1", "--model", "m"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rate", "-3"], "--rate must be > 0, got -3.0"),
        (["--rate", "nan"], "--rate must be > 0"),
        (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),
        (["--rate", "1", "--num-requests", "0"], "--num-requests must be >= 1, got 0"),
        (["--rate", "1", "--num-requests", "-5"], "--num-requests must be >= 1, got -5"),
        (["--rate", "1", "--arrival", "gamma", "--burstiness", "0"], "--burstiness must be > 0"),
        (["--rate", "1", "--arrival", "gamma", "--burstiness", "-2"], "--burstiness must be > 0"),
        (["--rate", "1", "--duration", "0"], "--duration must be > 0 seconds"),
        (["--rate", "1", "--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--rate", "1", "--warmup", "-1"], "--warmup must be >= 0"),
        (["--rate", "1", "--vocab-size", "3"], "--vocab-size must be >= 11"),
    ],
)
def test_every_numeric_option_is_checked(flags, message):
    proc = run_cli(*BENCH, *flags, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_run_in_which_nothing_succeeded_exits_non_zero():
    proc = run_cli(*BENCH, "--rate", "50", "--num-requests", "3", "--output-tokens", "2", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "no request succeeded (3 error)" in proc.stderr and "Traceback" not in proc.stderr


def test_ctrl_c_in_an_idle_open_loop_says_interrupted(server):
    args = ["--rate", "0.5", "--num-requests", "20", "--output-tokens", "2", "--arrival", "constant"]
    # the first request went out and is done: nothing in flight until the next arrival, 2 s later
    code, out, err = interrupted_bench(server, args, lambda: bool(server.requests))
    assert code == 130, err
    assert "interrupted: True" in out


def test_a_wrong_url_stops_after_the_first_failures_and_says_what_to_check():
    """A server that answers 404 to everything, given without /v1: bench stops after the first
    FAIL_FAST requests (not the 200 asked for), exits 1, and names the fix."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from otel_llm.bench.load import FAIL_FAST

    seen = []

    class NotHere(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.path)
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotHere)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        root = f"http://127.0.0.1:{httpd.server_address[1]}"
        args = ("bench", "--model", "m", "--rate", "20", "--num-requests", "200")
        p = run_cli(*args, "--base-url", root, check=False)
    finally:
        httpd.shutdown()
    assert p.returncode == 1, p.stderr
    assert f"stopped: the first {FAIL_FAST} requests failed and none succeeded" in p.stderr
    assert f"try --base-url {root}/v1" in p.stderr
    assert FAIL_FAST <= len(seen) < 20 and seen[0] == "/completions"
    # and a port nobody listens on
    p = run_cli(*args, "--base-url", "http://127.0.0.1:9/v1", check=False)
    assert p.returncode == 1 and "is a server listening at http://127.0.0.1:9/v1?" in p.stderr


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_no_collector_is_one_line_at_once_and_no_export_retries(server, protocol):
    """Nothing listens at the OTLP endpoint (no collector started): bench says so in one line
    before the load, with the fix, and does not retry the export (the SDK's 'Transient error' lines
    and their seconds) (#46 item 10)."""
    from support.otlp_helpers import free_port

    port = free_port()  # closed: nothing listens there
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
    }
    args = ("bench", "--base-url", server.base_url, "--model", "m", "--num-requests", "4", "--rate", "50")
    proc = run_cli(*args, "--output-tokens", "4", env=env)
    said = [ln for ln in proc.stderr.splitlines() if "nothing listens at" in ln]
    assert len(said) == 1 and f"127.0.0.1:{port}" in said[0] and "otel-llm collector" in said[0]
    assert "Transient error" not in proc.stderr and "completed 4" in proc.stdout
