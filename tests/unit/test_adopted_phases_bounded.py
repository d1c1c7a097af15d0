"""What another engine's own spans say of a request's phases is bounded by its request span (#47,
item 5): SGLang stage spans that end before they start, stages dated 1970 or 2200 under a root of
today, a vLLM ``llm_request`` of 1 s claiming 1e9 s of queue, prefill and decode. Each such phase
is unknown on the record (never negative, never larger than the request), the record says
``phase_outside_request`` (counted in ``llm_timeline_violations_total``), and the shared
``llm_*_duration_seconds`` histograms of the model never see it; a real collector's /metrics says
the same."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.otlp_helpers import body, provider, records, span
from support.sglang_fixture import SGLangRequest, emit

from otel_llm import semconv as sc

T0 = time.time_ns()
NOW_MS = T0 // 1_000_000


def sglang(**times) -> bytes:
    """One SGLang request at trace level 2, its stage times (ms after its start) as given."""
    mem = InMemorySpanExporter()
    tp = provider(mem, "sglang")
    emit(tp.get_tracer("sglang server"), SGLangRequest("8f1e2d3c4b5a69788796a5b4c3d2e1f0", **times), T0, 2)
    tp.shutdown()
    return encode_spans(mem.get_finished_spans()).SerializeToString()


def vllm_claiming(seconds: float) -> bytes:
    """vLLM's own llm_request of 1 s whose queue, prefill and decode each claim ``seconds``."""
    a = {
        sc.VLLM_TTFT: 0.05,
        sc.VLLM_E2E: 1.0,
        sc.VLLM_QUEUE: seconds,
        sc.VLLM_PREFILL: seconds,
        sc.VLLM_DECODE: seconds,
        sc.VLLM_PROMPT_TOKENS: 40,
        sc.VLLM_COMPLETION_TOKENS: 9,
        sc.VLLM_REQUEST_ID: "cmpl-big-0",
    }
    return body(span(7, 0xB7, sc.VLLM_SPAN_REQUEST, T0, T0 + 1_000_300_000, a))


CASES = {
    # the queue's end (first scheduled) after the last forward's (first generated): a prefill of -10 ms
    # (a stage span that itself ends before it starts is refused at intake, counted in partial_success)
    "sglang prefill ends before it starts": (sglang(prefill_waiting=(4.0, 40.0)), ("prefill",)),
    "sglang stages dated 1970": (sglang(prefill_waiting=(-NOW_MS + 1000, -NOW_MS + 1006)), ("queue", "front_end")),
    "sglang stages dated 2200": (
        sglang(prefill_forward=(7.3e12, 7.3e12 + 20), decode_ends=[7.3e12 + 30]),
        ("prefill", "decode"),
    ),
    "vllm claims 1e9 s": (vllm_claiming(1e9), ("queue", "prefill", "decode")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_phase_its_request_span_contradicts_is_unknown_and_said(case):
    data, unknown = CASES[case]
    b, _ = records(data)
    (r,) = b.records()
    for f in unknown:
        assert getattr(r, f) is None, (f, getattr(r, f))
    for f in ("front_end", "queue", "prefill", "decode"):
        v = getattr(r, f)
        assert v is None or 0 <= v <= r.e2e, (f, v)
    assert "phase_outside_request" in (r.violations or "").split(",")


def test_what_the_engine_said_within_its_span_is_kept_unflagged():
    b, _ = records(sglang(), vllm_claiming(0.2))
    got = {r.request_id: r for r in b.records()}
    assert got["8f1e2d3c4b5a69788796a5b4c3d2e1f0"].prefill == pytest.approx(0.020)
    assert got["cmpl-big-0"].queue == pytest.approx(0.2) and got["cmpl-big-0"].decode == pytest.approx(0.2)
    assert not any(r.violations for r in b.records())


def test_a_real_collector_keeps_them_out_of_the_models_histograms(make_collector):
    """Through OTLP/HTTP into a running collector: the histogram sums hold none of the 1e9 s, and
    the violations counter names each record."""
    c = make_collector()
    port = c.receivers[1].address[1]
    for data, _ in CASES.values():
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/traces", data, {"Content-Type": "application/x-protobuf"}, method="POST"
        )
        assert urllib.request.urlopen(req, timeout=10).status == 200
    deadline = time.monotonic() + 20
    while c.records_derived < len(CASES) and time.monotonic() < deadline:
        time.sleep(0.05)
    c.process(c.assembler.flush())
    host, mport = c.prometheus.address[:2]
    text = urllib.request.urlopen(f"http://{host}:{mport}/metrics", timeout=10).read().decode()
    for name in ("llm_queue_duration_seconds", "llm_prefill_duration_seconds", "llm_decode_duration_seconds"):
        sums = [float(v) for v in re.findall(rf"^{name}_sum\{{[^}}]*\}} (\S+)$", text, re.M)]
        assert all(0 <= s < 10 for s in sums), (name, sums)
    violations = re.findall(
        r'^llm_timeline_violations_total\{([^}]*kind="phase_outside_request"[^}]*)\} (\S+)$', text, re.M
    )
    assert sum(float(v) for _, v in violations) == len(CASES)
