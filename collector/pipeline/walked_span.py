"""The walked span: what the receivers hand to assembly and derivation, one flat tuple per span.

A tuple rather than an object because the collector handles hundreds of thousands of spans a
second: the C walker (:mod:`collector.receivers._otlp_walk`) builds them directly, and
:func:`collector.receivers.decode.walk_message` builds the same tuples from a parsed message.
Only spans the collector derives from are walked (the request spans and their phases, and the
engine's step spans, which :mod:`collector.pipeline.steps` keeps); the attribute slots hold the few
attributes those read, ``None`` where absent.

Layout (index constants below): ids are raw bytes (trace 16, span 8, parent 0 or 8); times are
Unix ns; ``code`` says which span it is; token-event arrays are bytes of native int64
(``np.frombuffer``); :data:`INVALID` marks an attribute of a type derivation does not read.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

import numpy as np

from otel_llm import semconv as sc
from otel_llm.semconv import Boundary

# span codes
CLIENT, ENGINE, QUEUE, PREFILL, DECODE, PREEMPTION, STREAM, STEP, FRONTEND, SERVER = range(10)
# SGLang's stage spans (collector/pipeline/sglang_spans.py)
SG_TOKENIZE, SG_DISPATCH, SG_REQUEST_PROCESS, SG_PREFILL_WAITING, SG_PREFILL_FORWARD = range(10, 15)
SG_CHUNKED_PREFILL, SG_DECODE_LOOP = range(15, 17)
GENAI_CLIENT = 17  # a GenAI client instrumentation's span (collector/pipeline/genai_client_spans.py)
SPECULATION = 18  # an engine's account of one request's speculative decoding (collector/pipeline/speculation.py)
KV_FETCH = 19  # a decode engine's account of one request's KV fetch (collector/pipeline/kv_fetch.py)
KV_HOLD = 20  # a prefill engine's account of one request's KV blocks held for the decode side (likewise)
KV_TRANSPORT = 21  # a P/D engine's connector worker's account of one request's transfers (likewise)
CODES = {
    sc.SPAN_CLIENT_REQUEST: CLIENT,
    sc.SPAN_REQUEST: ENGINE,
    sc.SPAN_QUEUE: QUEUE,
    sc.SPAN_PREFILL: PREFILL,
    sc.SPAN_DECODE: DECODE,
    sc.SPAN_PREEMPTION: PREEMPTION,
    sc.SPAN_STREAM: STREAM,
    sc.SPAN_STEP: STEP,
    sc.SPAN_ENGINE_SPECULATION: SPECULATION,
    sc.SPAN_ENGINE_KV_TRANSFER: KV_FETCH,
    sc.SPAN_ENGINE_KV_HOLD: KV_HOLD,
    sc.SPAN_ENGINE_KV_TRANSPORT: KV_TRANSPORT,
    sc.SPAN_FRONTEND: FRONTEND,
    **dict.fromkeys(sc.SERVER_SPAN_NAMES, SERVER),  # the HTTP server span ("POST /v1/completions", ...)
    sc.VLLM_SPAN_REQUEST: ENGINE,  # vLLM's own request span: an engine request span (collector/pipeline/vllm_spans.py)
    sc.SGLANG_SPAN_REQUEST: ENGINE,  # SGLang's root span, "Req <rid>" (a prefix; collector/pipeline/sglang_spans.py)
    sc.SGLANG_TOKENIZE: SG_TOKENIZE,
    sc.SGLANG_DISPATCH: SG_DISPATCH,
    sc.SGLANG_REQUEST_PROCESS: SG_REQUEST_PROCESS,
    sc.SGLANG_PREFILL_WAITING: SG_PREFILL_WAITING,
    sc.SGLANG_PREFILL_FORWARD: SG_PREFILL_FORWARD,
    sc.SGLANG_CHUNKED_PREFILL: SG_CHUNKED_PREFILL,
    sc.SGLANG_DECODE_LOOP: SG_DECODE_LOOP,
    **dict.fromkeys(sc.GENAI_CLIENT_SPAN_NAMES, GENAI_CLIENT),  # "chat <model>", ...: prefixes
}
#: names that end in "*": every span name beginning with the rest (the C walker does the same)
PREFIXES = tuple((name[:-1], code) for name, code in CODES.items() if name.endswith("*"))


def code_of(name: str) -> int | None:
    """The code of a span name (:data:`CODES`, prefixes included); None: not walked."""
    code = CODES.get(name)
    if code is None:
        for prefix, c in PREFIXES:
            if name.startswith(prefix):
                return c
    return code


NAMES = {v: k for k, v in reversed(CODES.items())}
BOUNDARY_OF = {CLIENT: Boundary.CLIENT, ENGINE: Boundary.ENGINE, SERVER: Boundary.SERVER}

QUEUE_INCOMPLETE = sc.QUEUE_INCOMPLETE

# attribute slots, in tuple order: (name in make_span, attribute key)
_ATTRIBUTES = (
    ("request_id", sc.REQUEST_ID),
    ("model", sc.REQUEST_MODEL),
    ("status", sc.STATUS),
    ("input_tokens", sc.INPUT_TOKENS),
    ("estimated", sc.TOKEN_EVENT_ESTIMATED),
    ("offsets", sc.TOKEN_EVENT_OFFSETS),
    ("tokens", sc.TOKEN_EVENT_TOKENS),
    ("incomplete", QUEUE_INCOMPLETE),
    ("run_id", sc.BENCH_RUN_ID),
    ("warmup", sc.BENCH_WARMUP),
    ("choice", sc.REQUEST_CHOICE),
    ("step_index", sc.STEP_INDEX),
    ("batch_size", sc.STEP_BATCH_SIZE),
    ("prefill_tokens", sc.STEP_PREFILL_TOKENS),
    ("decode_tokens", sc.STEP_DECODE_TOKENS),
    ("preempted", sc.STEP_PREEMPTED),
    ("kv_usage", sc.STEP_KV_USAGE),
    ("gpu_time_ns", sc.STEP_GPU_TIME_NS),
    ("chunk_offsets", sc.HTTP_CHUNK_OFFSETS),
    ("gen_offsets", sc.TOKEN_GENERATED_OFFSETS),
    ("gen_tokens", sc.TOKEN_GENERATED_TOKENS),
    ("sampling_p", sc.SAMPLING_PROBABILITY),
    ("waiting", sc.STEP_WAITING),
    ("wait_reason", sc.STEP_WAIT_REASON),
    ("after_abort", sc.TOKENS_AFTER_ABORT),
    ("violations", sc.TIMELINE_VIOLATIONS),
    ("output_tokens", sc.OUTPUT_TOKENS),
    ("send_offset", sc.CLIENT_SEND_OFFSET),
    # vLLM's own llm_request span (collector/pipeline/vllm_spans.py)
    ("gen_ai_request_id", sc.VLLM_REQUEST_ID),
    ("prompt_tokens", sc.VLLM_PROMPT_TOKENS),
    ("completion_tokens", sc.VLLM_COMPLETION_TOKENS),
    ("response_model", sc.VLLM_RESPONSE_MODEL),
    ("latency_ttft", sc.VLLM_TTFT),
    ("latency_e2e", sc.VLLM_E2E),
    ("latency_queue", sc.VLLM_QUEUE),
    ("latency_prefill", sc.VLLM_PREFILL),
    ("latency_decode", sc.VLLM_DECODE),
    # SGLang's root span (collector/pipeline/sglang_spans.py)
    ("sglang_rid", sc.SGLANG_RID),
    # a GenAI client instrumentation's span (collector/pipeline/genai_client_spans.py)
    ("operation", sc.OPERATION_NAME),
    ("time_to_first_chunk", sc.RESPONSE_TIME_TO_FIRST_CHUNK),
    ("response_id", sc.RESPONSE_ID),
    ("draft_tokens", sc.STEP_DRAFT_TOKENS),
    ("accepted_tokens", sc.STEP_ACCEPTED_TOKENS),
    ("internal_id", sc.REQUEST_INTERNAL_ID),
    # llm.engine.speculation (collector/pipeline/speculation.py)
    ("spec_method", sc.SPECULATION_METHOD),
    ("spec_event_tokens", sc.SPECULATION_EVENT_TOKENS),
    ("spec_event_drafts", sc.SPECULATION_EVENT_DRAFTS),
    ("spec_event_accepted", sc.SPECULATION_EVENT_ACCEPTED),
    ("spec_incomplete", sc.SPECULATION_INCOMPLETE),
    # a client's copy of the engine's own account (vLLM's response metrics)
    ("spec_draft_tokens", sc.SPECULATION_DRAFT_TOKENS),
    ("spec_accepted_tokens", sc.SPECULATION_ACCEPTED_TOKENS),
    ("spec_verify_steps", sc.SPECULATION_VERIFY_STEPS),
    # disaggregated prefill/decode, on llm.request (collector/pipeline/disagg.py)
    ("pd_role", sc.PD_ROLE),
    ("pd_connector", sc.PD_CONNECTOR),
    ("pd_engine_id", sc.PD_ENGINE_ID),
    ("pd_peer_request_id", sc.PD_PEER_REQUEST_ID),
    ("pd_peer_engine_id", sc.PD_PEER_ENGINE_ID),
    # llm.engine.kv_transfer (collector/pipeline/kv_fetch.py)
    ("kv_load_offset", sc.KV_LOAD_OFFSET),
    ("kv_received_offset", sc.KV_RECEIVED_OFFSET),
    ("kv_blocks", sc.KV_BLOCKS),
    ("kv_incomplete", sc.KV_INCOMPLETE),
    ("kv_failed_offset", sc.KV_FAILED_OFFSET),
    ("kv_bytes", sc.KV_BYTES),
    ("kv_wire", sc.KV_WIRE),
    ("kv_handshake", sc.KV_HANDSHAKE),
)
ATTRIBUTE_SLOTS = {key: i for i, (_, key) in enumerate(_ATTRIBUTES)}
RESOURCE_KEY = "service.name"

# tuple layout
TRACE_ID, SPAN_ID, PARENT_ID, CODE, KIND, START, END, STATUS_CODE, SERVICE = range(9)
(
    REQUEST_ID,
    MODEL,
    STATUS,
    INPUT_TOKENS,
    ESTIMATED,
    OFFSETS,
    TOKENS,
    INCOMPLETE,
    RUN_ID,
    WARMUP,
    CHOICE,
    STEP_INDEX,
    STEP_BATCH_SIZE,
    STEP_PREFILL_TOKENS,
    STEP_DECODE_TOKENS,
    STEP_PREEMPTED,
    STEP_KV_USAGE,
    STEP_GPU_TIME_NS,
    CHUNK_OFFSETS,
    GEN_OFFSETS,
    GEN_TOKENS,
    SAMPLING_P,
    STEP_WAITING,
    STEP_WAIT_REASON,
    AFTER_ABORT,
    VIOLATIONS,
    OUTPUT_TOKENS,
    SEND_OFFSET,
    GENAI_REQUEST_ID,
    PROMPT_TOKENS,
    COMPLETION_TOKENS,
    RESPONSE_MODEL,
    LATENCY_TTFT,
    LATENCY_E2E,
    LATENCY_QUEUE,
    LATENCY_PREFILL,
    LATENCY_DECODE,
    SGLANG_RID,
    OPERATION,
    TIME_TO_FIRST_CHUNK,
    RESPONSE_ID,
    STEP_DRAFT_TOKENS,
    STEP_ACCEPTED_TOKENS,
    INTERNAL_ID,
    SPEC_METHOD,
    SPEC_EVENT_TOKENS,
    SPEC_EVENT_DRAFTS,
    SPEC_EVENT_ACCEPTED,
    SPEC_INCOMPLETE,
    SPEC_DRAFT_TOKENS,
    SPEC_ACCEPTED_TOKENS,
    SPEC_VERIFY_STEPS,
    PD_ROLE,
    PD_CONNECTOR,
    PD_ENGINE_ID,
    PD_PEER_REQUEST_ID,
    PD_PEER_ENGINE_ID,
    KV_LOAD_OFFSET,
    KV_RECEIVED_OFFSET,
    KV_BLOCKS,
    KV_INCOMPLETE,
    KV_FAILED_OFFSET,
    KV_BYTES,
    KV_WIRE,
    KV_HANDSHAKE,
) = range(9, 9 + len(ATTRIBUTE_SLOTS))
WIDTH = 9 + len(ATTRIBUTE_SLOTS)


class _Invalid:
    """An attribute present with a type derivation does not read (a map, bytes, a mixed array)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "INVALID"

    def __reduce__(self):
        return "INVALID"


INVALID = _Invalid()

WalkedSpan = tuple


def make_span(
    trace_id: bytes | str,
    span_id: bytes | str,
    name: str,
    *,
    parent: bytes | str = b"",
    start: int = 0,
    end: int = 0,
    kind: int = 1,
    status_code: int = 0,
    service: Any = None,
    **attrs: Any,
) -> WalkedSpan:
    """A walked span built by hand (tests, tools): ids as bytes or hex; ``attrs`` by slot name
    (``request_id=``, ``offsets=[...]``: int lists become packed int64 bytes)."""
    b = lambda x: bytes.fromhex(x) if isinstance(x, str) else x
    slots: list[Any] = [None] * len(ATTRIBUTE_SLOTS)
    names = [name for name, _ in _ATTRIBUTES]
    for k, v in attrs.items():
        if isinstance(v, list):
            v = np.asarray(v, dtype=np.int64).tobytes()
        slots[names.index(k)] = v
    return (b(trace_id), b(span_id), b(parent), CODES[name], kind, start, end, status_code, service, *slots)


def split_code(spans: list[tuple], code: int) -> tuple[list[tuple], list[tuple]]:
    """Walked spans -> (those of other codes, those of ``code``): the spans that bypass trace
    assembly (engine steps, an engine's per-request accounts) taken out of one export request."""
    if code not in map(itemgetter(CODE), spans):  # iterated in C: most requests hold none
        return spans, []
    return [s for s in spans if s[CODE] != code], [s for s in spans if s[CODE] == code]


def split_codes(spans: list[tuple], codes: frozenset[int]) -> tuple[list[tuple], dict[int, list[tuple]]]:
    """Walked spans -> (those of other codes, those of each of ``codes`` by code): one pass for
    every kind of account (:func:`split_code` for one)."""
    if codes.isdisjoint(map(itemgetter(CODE), spans)):  # iterated in C: most requests hold none
        return spans, {}
    rest, out = [], {}
    for s in spans:
        c = s[CODE]
        if c in codes:
            out.setdefault(c, []).append(s)
        else:
            rest.append(s)
    return rest, out
