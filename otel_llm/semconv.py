"""Span names and attribute keys: the contract between engine_hooks, the client side and the
collector (docs/architecture.md, "Span conventions"). GenAI semantic-convention names where one exists;
engine internals under ``llm.``. Add keys freely; change none of these silently."""

from dataclasses import dataclass


class Boundary:
    """The values of ``llm.boundary``: where a request's times were taken (docs/metrics/spec.md).
    Plain ``str`` constants, not enum members: what goes into spans, the store and JSON is the
    string itself, compared at no cost on the hot path."""

    CLIENT = "client"  # the caller: send to the stream's close
    SERVER = "server"  # the HTTP server span: the request read to the last byte written
    ENGINE = "engine"  # the engine's front end: arrival to finish
    ALL = (CLIENT, SERVER, ENGINE)


class RequestStatus:
    """The values of ``llm.request.status`` (docs/metrics/spec.md), in the order
    ``otel_llm.metrics.timeline`` codes them; plain ``str`` constants, as :class:`Boundary`."""

    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"  # the caller went away, or the engine aborted it
    REJECTED = "rejected"  # never admitted (HTTP 4xx/429, a full queue)
    ALL = (OK, ERROR, CANCELLED, REJECTED)


class PairedBy:
    """How the collector paired a request's client record with its engine record (the store's
    ``paired_by``): one trace held both, or the client's ``gen_ai.response.id`` was the engine's id."""

    TRACE = "trace"
    ID = "id"


class PdRole:
    """The values of ``llm.pd.role``: an engine's leg of a disaggregated request (``BOTH``: an
    engine with a KV connector that served it whole)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


# span names
SPAN_CLIENT_REQUEST = "llm.client.request"
SPAN_REQUEST = "llm.request"
SPAN_FRONTEND = "llm.frontend"  # arrival -> queued: rendering, tokenization, hand-off to the engine core
SPAN_QUEUE = "llm.queue"  # queued -> first scheduled: the scheduler's queue
SPAN_PREFILL = "llm.prefill"
SPAN_DECODE = "llm.decode"
SPAN_PREEMPTION = "llm.preemption"
SPAN_STREAM = "llm.stream"
SPAN_STEP = "llm.engine.step"
SPAN_STEPS = "llm.engine.steps"  # parent of a run of step spans (one trace per export batch)
# a preemption as an engine saw it where its request is not traced (vLLM's engine core): a span of
# its own at the moment, named by llm.request.internal_id (the front end's llm.preemption is its twin)
SPAN_ENGINE_PREEMPTION = "llm.engine.preemption"
#: one request's speculative decoding, from an engine process that does not trace its requests
#: (vLLM's engine core), named by llm.request.internal_id (engine_hooks/spans/speculation.py)
SPAN_ENGINE_SPECULATION = "llm.engine.speculation"
SPAN_ENGINE_KV_TRANSFER = "llm.engine.kv_transfer"  # a decode engine's KV fetch of one request (P/D)
#: a prefill engine's hold of one request's KV blocks for its decode engine: the request finished ->
#: the blocks freed (P/D; llm.kv_transfer.blocks, llm.kv_transfer.incomplete on it too)
SPAN_ENGINE_KV_HOLD = "llm.engine.kv_hold"
#: what a P/D engine's KV connector's transport said of one request's transfers (NIXL's telemetry per
#: transfer handle, summed: llm.kv_transfer.bytes, .wire_ns), from the connector's worker process
SPAN_ENGINE_KV_TRANSPORT = "llm.engine.kv_transport"

SPAN_BENCH_RUN = "llm.bench.run"

# vLLM's own tracing (``--otlp-traces-endpoint``): one span per request, no child spans, no token
# events; what it measured as attributes, in seconds (vllm/tracing/utils.py, vLLM 0.32). The
# collector takes it as an engine boundary where our hooks are not there (collector/pipeline/vllm_spans.py)
VLLM_SPAN_REQUEST = "llm_request"
VLLM_REQUEST_ID = "gen_ai.request.id"
VLLM_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"  # the deprecated name vLLM still sends
VLLM_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"  # likewise
VLLM_RESPONSE_MODEL = "gen_ai.response.model"
VLLM_TTFT = "gen_ai.latency.time_to_first_token"  # arrival -> the front end's first output
VLLM_E2E = "gen_ai.latency.e2e"  # arrival -> the front end's last output
VLLM_QUEUE = "gen_ai.latency.time_in_queue"  # queued -> first scheduled (engine core clock)
VLLM_PREFILL = "gen_ai.latency.time_in_model_prefill"  # first scheduled -> first token (engine core)
VLLM_DECODE = "gen_ai.latency.time_in_model_decode"  # first -> last token (engine core)

# A GenAI client instrumentation's span (the OpenTelemetry GenAI conventions: "{gen_ai.operation.name}
# {gen_ai.request.model}", kind CLIENT), for the operations that generate text. The collector takes
# one as the client boundary where otel-llm's client span is absent (collector/pipeline/genai_client_spans.py)
GENAI_CLIENT_SPAN_NAMES = ("chat *", "text_completion *", "generate_content *")  # prefixes
GENAI_CLIENT_OPERATIONS = ("chat", "text_completion", "generate_content")

# SGLang's own tracing (--enable-trace, python/sglang/srt/tracing/trace.py): a root span per request
# named "Req <first 8 characters of the rid>" (attribute rid), a span per thread under it, and a
# span per stage under those, named by the stage (trace_metric_wrapper.RequestStage), each at a
# trace level (collector/pipeline/sglang_spans.py)
SGLANG_SPAN_REQUEST = "Req *"  # a prefix: the walker takes every name that begins with "Req "
SGLANG_RID = "rid"
SGLANG_TOKENIZE = "tokenize"  # level 1, the tokenizer manager
SGLANG_DISPATCH = "dispatch"  # level 2, tokenizer -> scheduler
SGLANG_REQUEST_PROCESS = "request_process"  # level 1, the scheduler takes the request in
SGLANG_PREFILL_WAITING = "prefill_waiting"  # level 1, the scheduler's queue
SGLANG_PREFILL_FORWARD = "prefill_forward"  # level 1, the prefill's forward pass
SGLANG_CHUNKED_PREFILL = "chunked_prefill"  # level 3, one chunk of a chunked prefill
SGLANG_DECODE_LOOP = "decode_loop"  # level 2, one decode iteration (one token)

# the HTTP server boundary (engine_hooks.asgi): OpenTelemetry HTTP server conventions
HTTP_METHOD = "http.request.method"
HTTP_STATUS = "http.response.status_code"
URL_PATH = "url.path"
HTTP_RESPONSE_START = "llm.http.response_start_offset_ns"  # int: ns after the span start
# int: ns after the span start (its first byte read) at which the HTTP app was called: HTTP
# parsing and the wait for the server's event loop
HTTP_APP_START = "llm.http.app_start_offset_ns"
# str on llm.request: the orderings the hooks saw broken, comma-separated (collector.pipeline.invariants.KINDS)
TIMELINE_VIOLATIONS = "llm.timeline.violations"
# int on llm.client.request: ns after the span start (the caller's call) at which the client library
# began writing the request (httpx/httpcore's send_request_headers.started): what came before is the
# client's own work (building the request, waiting for a pooled connection, connecting)
CLIENT_SEND_OFFSET = "llm.client.send_offset_ns"
HTTP_CHUNK_OFFSETS = "llm.http.chunk_offsets_ns"  # int[]: each body chunk written, ns after the span start
#: the routes whose server spans the collector derives (span name "{method} {path}")
SERVER_SPAN_NAMES = (
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/responses",
)  # one per otel-llm bench run, carrying its conditions

# attributes
BOUNDARY = "llm.boundary"  # a Boundary value
REQUEST_ID = "llm.request.id"
TOKEN_EVENT_OFFSETS = "llm.token_event.offsets_ns"  # int[]: ns after the span start
TOKEN_EVENT_TOKENS = "llm.token_event.tokens"  # int[]: tokens in each event
#: on llm.request, from an engine that says when it generated tokens (vLLM: the engine core's output
#: time), apart from when it handed them out: ns after the span start, and tokens in each (absent:
#: as TOKEN_EVENT_TOKENS, one generation per event)
TOKEN_GENERATED_OFFSETS = "llm.token_generated.offsets_ns"  # int[]
TOKEN_GENERATED_TOKENS = "llm.token_generated.tokens"  # int[]
TOKEN_EVENT_ESTIMATED = "llm.token_event.estimated"  # bool: token counts estimated, not from usage
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_ID = "gen_ai.response.id"
FINISH_REASONS = "gen_ai.response.finish_reasons"
OPERATION_NAME = "gen_ai.operation.name"
REQUEST_STREAM = "gen_ai.request.stream"  # bool on llm.client.request: the call asked for a stream
#: double on llm.client.request (a streamed call that got a chunk with a token): seconds from the
#: call to its first token, the client's TTFT as the GenAI conventions name it
RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
ERROR_TYPE = "error.type"
STATUS = "llm.request.status"  # a RequestStatus value
PREEMPTIONS = "llm.request.preemptions"
PREEMPTION_MODE = "llm.preemption.mode"  # recompute | swap
#: on llm.preemption: the tokens whose KV the request held when preempted (prompt + generated but the
#: newest, or what the engine says), which a recompute preemption must compute again (an upper bound:
#: the prefix cache may still hold some)
PREEMPTION_RECOMPUTE_TOKENS = "llm.preemption.recompute_tokens"
PREEMPTION_KV_USAGE = "llm.preemption.kv_cache_usage"  # fraction 0..1 of the KV cache used when it preempted
# on an aborted request's llm.request: tokens the engine generated for it after the abort (dropped)
TOKENS_AFTER_ABORT = "llm.usage.tokens_after_abort"
#: on llm.request, where the engine says (vLLM's prefill stats): prompt tokens served from a cache
#: (GenAI semantic conventions), and where the prompt's tokens came from
CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
PREFILL_COMPUTED_TOKENS = "llm.prefill.computed_tokens"  # computed by this engine's forward passes
PREFILL_LOCAL_CACHED_TOKENS = "llm.prefill.cached_tokens.local"  # this engine's prefix cache
PREFILL_EXTERNAL_CACHED_TOKENS = "llm.prefill.cached_tokens.external"  # KV transferred from elsewhere
ENGINE_NAME = "llm.engine.name"
#: on a request span kept by a sampler that decided itself (a root, or a sampler that is not
#: parent-based): the probability it kept it with (OTEL_TRACES_SAMPLER / _ARG); absent when 1
#: or not known. The collector weighs what it counts by 1 / this.
SAMPLING_PROBABILITY = "llm.sampling.probability"

STEP_INDEX = "llm.step.index"
STEP_BATCH_SIZE = "llm.step.batch_size"
STEP_PREFILL_TOKENS = "llm.step.prefill_tokens"
STEP_DECODE_TOKENS = "llm.step.decode_tokens"
STEP_PREEMPTED = "llm.step.preempted"
STEP_KV_USAGE = "llm.step.kv_cache_usage"  # fraction 0..1
STEP_GPU_TIME_NS = "llm.step.gpu_time_ns"  # CUDA only
STEP_WAITING = "llm.step.waiting"  # requests left waiting for a place in the batch after the step
#: why they waited, where the engine says (vLLM: max_num_seqs, token_budget, deferred, kv_cache, other)
STEP_WAIT_REASON = "llm.step.wait_reason"
#: speculative decoding (absent without it): the draft tokens the step verified (proposed, less
#: any a grammar invalidated), and how many of them the target model accepted; vLLM counts the
#: same in ``vllm:spec_decode_num_draft_tokens`` / ``vllm:spec_decode_num_accepted_tokens``
STEP_DRAFT_TOKENS = "llm.step.draft_tokens"
STEP_ACCEPTED_TOKENS = "llm.step.accepted_tokens"
#: on llm.engine.speculation: how the engine drafts (vLLM's speculative_config method: ngram,
#: draft_model, eagle, mtp, ...) and k, the most drafts a step proposes
SPECULATION_METHOD = "llm.speculation.method"
SPECULATION_K = "llm.speculation.num_speculative_tokens"
SPECULATION_DRAFT_TOKENS = "llm.speculation.draft_tokens"  # the request's drafts verified, in all
SPECULATION_ACCEPTED_TOKENS = "llm.speculation.accepted_tokens"  # of them, accepted
SPECULATION_VERIFY_STEPS = "llm.speculation.verify_steps"  # its steps that verified drafts
#: int[], one entry per step that gave the request tokens (its token events, in order): the
#: tokens, the drafts verified (-1: none that step) and of them those accepted
SPECULATION_EVENT_TOKENS = "llm.speculation.event_tokens"
SPECULATION_EVENT_DRAFTS = "llm.speculation.event_draft_tokens"
SPECULATION_EVENT_ACCEPTED = "llm.speculation.event_accepted_tokens"
SPECULATION_INCOMPLETE = "llm.speculation.incomplete"  # still in flight at shutdown, or evicted
#: on llm.client.request: the engine's own per-request account as its response said it (vLLM's
#: metrics.speculative_decoding with --per-request-spec-decode-metrics), the totals above and, at
#: its detailed level, int[] over its verify steps only
SPECULATION_STEP_DRAFTS = "llm.speculation.step_draft_tokens"
SPECULATION_STEP_ACCEPTED = "llm.speculation.step_accepted_tokens"

REQUEST_CHOICE = "llm.request.choice"  # a request with n > 1 choices: one span per choice, this its index
STREAMING = "llm.request.streaming"  # on llm.client.request: the call streamed (no token events otherwise)
REQUEST_INTERNAL_ID = "llm.request.internal_id"  # the engine's own id, where it differs from llm.request.id
#: disaggregated prefill/decode, on llm.request (absent on an engine that serves the whole request):
#: this engine's leg (prefill: it computes the prompt and hands its KV cache on; decode: it takes the
#: KV cache from a prefill engine and generates), the KV connector (vLLM's kv_connector: NixlConnector,
#: ExampleConnector, ...), this engine's id and, where the request names it, its peer's request id and
#: engine id (vLLM's kv_transfer_params remote_request_id / remote_engine_id): how the collector joins
#: the two legs of one request, never by time
PD_ROLE = "llm.pd.role"
PD_CONNECTOR = "llm.pd.connector"
PD_ENGINE_ID = "llm.pd.engine_id"
PD_PEER_REQUEST_ID = "llm.pd.peer.request_id"
PD_PEER_ENGINE_ID = "llm.pd.peer.engine_id"
#: on llm.engine.kv_transfer (a decode engine's KV fetch of one request; starts when its scheduler
#: took the request, its KV still remote, and ends when it left the fetch: scheduled, finished or
#: aborted): when the load started and when the scheduler saw the transfer complete (ns after the
#: span's start; absent where not seen), the KV blocks the load asked for
KV_LOAD_OFFSET = "llm.kv_transfer.load_start_offset_ns"
KV_RECEIVED_OFFSET = "llm.kv_transfer.received_offset_ns"
KV_BLOCKS = "llm.kv_transfer.blocks"
KV_BYTES = "llm.kv_transfer.bytes"  # bytes moved, as the transport says (NIXL's telemetry), summed
KV_HANDSHAKE = "llm.kv_transfer.handshake_ns"  # its wait for the worker's handshake with a new peer
KV_WIRE = "llm.kv_transfer.wire_ns"  # the transport's own time for the request's transfers (NIXL xferDuration)
KV_FAILED_OFFSET = "llm.kv_transfer.failed_offset_ns"  # the connector said the load failed, ns after the start
KV_INCOMPLETE = "llm.kv_transfer.incomplete"  # still in the fetch at shutdown, or evicted
REQUEST_INCOMPLETE = "llm.request.incomplete"  # exported at shutdown before it finished
QUEUE_INCOMPLETE = "llm.queue.incomplete"  # on llm.queue: the engine never saw the request scheduled
STREAM_EVENTS = "llm.stream.events"  # on llm.stream: outputs handed to the transport
STEPS_COUNT = "llm.steps.count"  # on llm.engine.steps: the step spans below it
STEPS_FIRST_INDEX = "llm.steps.first_index"

# opt-in content (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT / capture_content=True)
PROMPT_TEXT = "llm.prompt.text"
COMPLETION_TEXT = "llm.completion.text"

# otel-llm bench: run conditions, as resource attributes of its spans (llm.bench.<condition>)
BENCH_PREFIX = "llm.bench."
BENCH_WARMUP = "llm.bench.warmup"  # on llm.client.request: a warm-up request, excluded from results
BENCH_RUN_ID = "llm.bench.run_id"  # resource and span attribute: which bench run a request belongs to


#: Every GenAI semantic-convention name otel-llm emits on its spans, checked against the conventions
#: (tests/unit/test_genai_names.py): each must be a current name, none one the conventions replaced.
GENAI_EMITTED = (
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    CACHE_READ_INPUT_TOKENS,
    REQUEST_MODEL,
    REQUEST_STREAM,
    RESPONSE_ID,
    RESPONSE_TIME_TO_FIRST_CHUNK,
    FINISH_REASONS,
    OPERATION_NAME,
)
#: gen_ai.* names the collector reads from spans others send, not emitted by otel-llm: the older
#: names the conventions replaced (vLLM still sends them) and vLLM's own, outside the conventions
GENAI_ACCEPTED = (
    VLLM_PROMPT_TOKENS,
    VLLM_COMPLETION_TOKENS,
    VLLM_RESPONSE_MODEL,
    VLLM_REQUEST_ID,
    VLLM_TTFT,
    VLLM_E2E,
    VLLM_QUEUE,
    VLLM_PREFILL,
    VLLM_DECODE,
)


@dataclass(frozen=True)
class TracerMetric:
    """One of tracing's own metrics: what a traced process sends about its tracing
    (:mod:`engine_hooks.spans.self_metrics`, a cumulative counter per pipeline) and the collector
    keeps for its ``/metrics`` (:mod:`collector.receivers.tracer_cost`). ``unit``: UCUM, as the
    instrument declares it; ``help``: what it counts, on both sides."""

    name: str
    unit: str
    help: str


# tracing's own metrics (otel_llm.tracer.*), declared once for the sender, the collector, the
# dashboard generator and docs/configuration.md
TRACER_CPU_TIME = TracerMetric(
    "otel_llm.tracer.cpu_time",
    "s",
    "CPU seconds a traced process spent building and exporting its spans (its span thread and its span "
    "process; the hooks on the engine's threads are not in it)",
)
TRACER_SPANS_EXPORTED = TracerMetric(
    "otel_llm.tracer.spans.exported", "{span}", "Spans a traced process handed to its exporter"
)
TRACER_SPANS_DROPPED = TracerMetric(
    "otel_llm.tracer.spans.dropped", "{span}", "Spans a traced process's exporter failed to send"
)
TRACER_EVENTS_DROPPED = TracerMetric(
    "otel_llm.tracer.events.dropped",
    "{event}",
    "Hook events dropped because the recorder between span-building rounds was full",
)
TRACER_REQUESTS_UNSAMPLED = TracerMetric(
    "otel_llm.tracer.requests.unsampled",
    "{request}",
    "Requests a traced process finished but its sampler did not keep",
)
TRACER_REQUESTS = TracerMetric(
    "otel_llm.tracer.requests", "{request}", "Finished requests a traced process's pipeline saw"
)
TRACER_STEPS = TracerMetric("otel_llm.tracer.steps", "{step}", "Engine steps a traced process's pipeline saw")
TRACER_METRICS = (
    TRACER_CPU_TIME,
    TRACER_SPANS_EXPORTED,
    TRACER_SPANS_DROPPED,
    TRACER_EVENTS_DROPPED,
    TRACER_REQUESTS_UNSAMPLED,
    TRACER_REQUESTS,
    TRACER_STEPS,
)
#: what every tracer metric's name begins with (the collector keeps no other)
TRACER_PREFIX = "otel_llm.tracer."
