"""A traced vLLM server whose OTLP endpoint accepts connections and never answers (#47, items 3
and 4): it answers as it would untraced, each traced process keeps one span process, and SIGTERM
stops it within vLLM's own stop plus one OTEL_LLM_EXIT_TIMEOUT, each traced process saying in one
line what it dropped. Before: span processes went 1 -> 2 -> 3 (about 65 MiB each) and the stop
took 63 s (a 30 s flush, then 30 s for each retired span process)."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request

import pytest
from conftest import start_vllm_server
from support.hung_endpoint import hung_endpoint, span_processes

pytestmark = pytest.mark.slow


def _stream(base_url: str, model: str, prompt: str) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "stream": True, "ignore_eos": True}
    req = urllib.request.Request(
        base_url + "/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        got = r.read()
    assert got.rstrip().endswith(b"data: [DONE]"), got[-200:]
    return r.status


def test_a_hung_collector_neither_piles_up_span_processes_nor_holds_the_stop(tiny_model, tmp_path):
    import signal

    from engine_hooks.tiny_model import prompt, stop_cpu_server

    with hung_endpoint() as port:
        env = {
            "OTEL_LLM_ENABLE": "1",
            "OTEL_LLM_DETAIL": "steps",  # the most a round sends
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",  # the tracer's metrics go there too
            "OTEL_LLM_SCHEDULE_DELAY": "50",
        }
        server, base_url = start_vllm_server(tiny_model, env)
        log = os.path.join(os.path.dirname(tiny_model), f"vllm-server-{base_url.split(':')[2].split('/')[0]}.log")
        try:
            statuses: list[int] = []
            most: dict[int, int] = {}
            end = time.monotonic() + 25

            def load(k: int) -> None:
                i = 0
                while time.monotonic() < end:
                    statuses.append(_stream(base_url, tiny_model, prompt(24 + k + i % 7)))
                    i += 1

            threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                for parent, kids in span_processes(server.pid).items():
                    most[parent] = max(most.get(parent, 0), len(kids))
                time.sleep(0.5)
            for t in threads:
                t.join()
            assert statuses and set(statuses) == {200}
            assert most and max(most.values()) == 1, f"span processes at once, per traced process: {most}"
            children = [pid for kids in span_processes(server.pid).values() for pid in kids]
            t0 = time.monotonic()
            server.send_signal(signal.SIGTERM)
            server.wait(60)
            stop_s = time.monotonic() - t0
        finally:
            stop_cpu_server(server, 0)
    print(f"{len(statuses)} requests; span processes at once {most}; the stop took {stop_s:.1f} s")
    # vLLM's own stop (0.3 s untraced here) and the exit deadline (OTEL_LLM_EXIT_TIMEOUT, 5 s)
    assert stop_s < 5 + 5, f"the stop took {stop_s:.1f} s"
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in children):
        time.sleep(0.1)
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")], "a span process outlived its engine"
    with open(log) as fh:
        said = [line for line in fh if "exit after" in line]
    assert said, "no traced process said what its exit dropped"
    for line in said:  # one line per traced process: what it exported and dropped, and where it sent
        assert re.search(r"\d+ spans exported, [1-9]\d* dropped", line) and f"127.0.0.1:{port}" in line, line
