"""The HTTP server boundary inside vLLM's API server (engine_hooks.asgi): one SERVER span per HTTP
request with the OpenTelemetry HTTP conventions, parented by the caller's traceparent and the
parent of the engine's llm.request, holding the time of every body chunk written. Real server on
the CPU, requests shaped by hand at the wire level (raw HTTP with a traceparent)."""

from __future__ import annotations

import json
import socket
import urllib.parse

import pytest
from conftest import start_vllm_server

from otel_llm import semconv as sc
from otel_llm.otlp.span_records import read_trace_file

pytestmark = pytest.mark.slow

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def raw_stream(base_url: str, body: dict | None, headers, path: str = "/v1/completions") -> list[bytes]:
    """POST (GET without a body) by hand on a socket, the headers as given (a dict, or pairs: the
    same name twice); the response's body chunks as they arrive."""
    u = urllib.parse.urlparse(base_url)
    data = b"" if body is None else json.dumps(body).encode()
    method = "GET" if body is None else "POST"
    head = f"{method} {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
    pairs = headers.items() if isinstance(headers, dict) else headers
    head += "".join(f"{k}: {v}\r\n" for k, v in pairs)
    head += f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    out = []
    with socket.create_connection((u.hostname, u.port), timeout=60) as s:
        s.sendall(head.encode() + data)
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out.append(chunk)
    return out


def test_server_span_parents_the_engine_request(tiny_model, tmp_path):
    from engine_hooks.tiny_model import prompt, stop_cpu_server

    traces = tmp_path / "server.jsonl"
    env = {"OTEL_LLM_ENABLE": "1", "OTEL_LLM_TRACES_FILE": str(traces), "OTEL_LLM_SCHEDULE_DELAY": "50"}
    server, base_url = start_vllm_server(tiny_model, env)
    try:
        body = {"model": tiny_model, "prompt": prompt(32), "max_tokens": 12, "stream": True, "ignore_eos": True}
        got = b"".join(raw_stream(base_url, body, {"traceparent": f"00-{TRACE}-{PARENT}-01"}))
        assert got.startswith(b"HTTP/1.1 200") and got.rstrip().endswith(b"data: [DONE]\n\n\r\n0")
        # vLLM merges the outputs a slow reader has not taken yet into one event (" w93 w426"),
        # so a loaded machine sends fewer than 12 events; the tokens are counted on the span
        events = got.count(b"data: ")
        assert events >= 3 and got.count(b'"finish_reason":"length"') == 1
        plain = b"".join(raw_stream(base_url, {**body, "stream": False}, {}))
        assert plain.startswith(b"HTTP/1.1 200")
    finally:
        stop_cpu_server(server)
    spans = read_trace_file(traces)
    http = [s for s in spans if s.attributes.get(sc.BOUNDARY) == "server"]
    assert len(http) == 2, [s.name for s in spans]
    streamed = next(s for s in http if s.trace_id == TRACE)
    assert streamed.name == "POST /v1/completions" and streamed.kind == 2  # SERVER
    assert streamed.parent_span_id == PARENT
    a = streamed.attributes
    assert a[sc.HTTP_METHOD] == "POST" and a[sc.URL_PATH] == "/v1/completions" and a[sc.HTTP_STATUS] == 200
    chunks = a[sc.HTTP_CHUNK_OFFSETS]
    assert len(chunks) >= events and chunks == sorted(chunks) and 0 <= a[sc.HTTP_RESPONSE_START] <= chunks[0]
    assert chunks[-1] <= streamed.end_ns - streamed.start_ns
    (req,) = [s for s in spans if s.name == sc.SPAN_REQUEST and s.trace_id == TRACE]
    assert req.attributes[sc.OUTPUT_TOKENS] == 12
    assert req.parent_span_id == streamed.span_id  # the engine's span is the HTTP span's child
    assert streamed.start_ns <= req.start_ns and req.end_ns <= streamed.end_ns
    # the engine core's own time for each output, before the front end handed it out
    gen, out = req.attributes[sc.TOKEN_GENERATED_OFFSETS], req.attributes[sc.TOKEN_EVENT_OFFSETS]
    assert len(gen) == len(out) and all(0 <= g <= o for g, o in zip(gen, out)) and gen == sorted(gen)
    assert sc.TOKEN_GENERATED_TOKENS not in req.attributes  # the same counts as the token events
    # the first chunk carrying a token is written after the engine handed the first token out
    first_out = req.start_ns + req.attributes[sc.TOKEN_EVENT_OFFSETS][0]
    assert any(streamed.start_ns + c >= first_out for c in chunks)
    other = next(s for s in http if s.trace_id != TRACE)
    assert other.parent_span_id in (None, "") and len(other.attributes[sc.HTTP_CHUNK_OFFSETS]) >= 1


BAD_FLAGS = ["100", "1ff", "0x1ff", "1_00", "f" * 40]


def test_a_malformed_or_repeated_traceparent_never_changes_the_answer(tiny_model, tmp_path):
    """#47's first two attacks on a real traced server: a traceparent whose flags are not two hex
    digits made every traced endpoint answer 400 (500 without the C accelerator), where plain vLLM
    answers 200; now it is ignored as if absent. A second traceparent header moved the engine's
    spans to another trace than the server span's; now every boundary of the request is in one."""
    from engine_hooks.tiny_model import prompt, stop_cpu_server

    traces = tmp_path / "server.jsonl"
    env = {"OTEL_LLM_ENABLE": "1", "OTEL_LLM_TRACES_FILE": str(traces), "OTEL_LLM_SCHEDULE_DELAY": "50"}
    server, base_url = start_vllm_server(tiny_model, env)
    body = {"model": tiny_model, "prompt": prompt(16), "max_tokens": 4, "ignore_eos": True}
    sent = []  # (path, trace id it must land in or None)
    try:
        for flags in BAD_FLAGS:
            tp = f"00-{TRACE}-{PARENT}-{flags}"
            for path, b in (
                ("/v1/completions", {**body, "stream": True}),
                ("/v1/completions", body),
                ("/tokenize", {"model": tiny_model, "prompt": "w1 w2"}),
                ("/v1/models", None),
            ):
                got = b"".join(raw_stream(base_url, b, {"traceparent": tp}, path=path))
                assert got.startswith(b"HTTP/1.1 200"), (flags, path, got[:300])
                sent.append((path, None))
        other = "0af7651916cd43dd8448eb211c80319c"
        for spelled in (("traceparent", "traceparent"), ("TraceParent", "TRACEPARENT", "traceparent")):
            headers = [(spelled[0], f"00-{TRACE}-{PARENT}-01")]
            headers += [(name, f"00-{other}-b7ad6b7169203331-01") for name in spelled[1:]]
            got = b"".join(raw_stream(base_url, {**body, "stream": True}, headers))
            assert got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in got
    finally:
        stop_cpu_server(server)
    spans = read_trace_file(traces)
    http = [s for s in spans if s.attributes.get(sc.BOUNDARY) == "server"]
    engine = [s for s in spans if s.name == sc.SPAN_REQUEST]
    # every request got its server span (an invalid parent is ignored: a new trace, not ours)
    assert len(http) == len(sent) + 2 and sum(s.trace_id == TRACE for s in http) == 2
    for s in http:
        assert s.attributes[sc.HTTP_STATUS] == 200
        if s.trace_id != TRACE:
            assert s.parent_span_id in (None, "")
    # each completion's engine span is the child of its own server span, in its trace
    by_id = {s.span_id: s for s in http}
    assert len(engine) == 2 * len(BAD_FLAGS) + 2
    for e in engine:
        parent = by_id[e.parent_span_id]
        assert parent.trace_id == e.trace_id and parent.attributes[sc.URL_PATH] == "/v1/completions"
    assert sum(e.trace_id == TRACE for e in engine) == 2 and not any(
        s.trace_id == "0af7651916cd43dd8448eb211c80319c" for s in spans
    )
