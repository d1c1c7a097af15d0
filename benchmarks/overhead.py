"""Benchmark: what engine_hooks costs vLLM, measured side by side in one run.

Three engines on the tiny random-weight model (CPU): plain vLLM, vLLM wrapped by
``engine_hooks.instrument``, and vLLM with its own OpenTelemetry tracing
(``otlp_traces_endpoint``), both exporting over OTLP/gRPC to a local sink that discards. They run the same batch
(128 requests x 256 output tokens by default) in alternating rounds, so drift hits all three
alike. Prints output-token throughput per engine, the median instrumented/plain and
vllm-tracing/plain ratios, and the hook cost per engine step in microseconds (hot path, timed
on the real wrapped scheduler methods; and the span-building thread's CPU time per step).

Run: ``.venv/bin/python benchmarks/overhead.py [--rounds 5] [--requests 128] [--tokens 256] [--detail LEVEL]``

``--detail request|phases|steps`` traces the instrumented engine at that ``OTEL_LLM_DETAIL`` level
(default: phases, the default level); ``--detail all`` runs the benchmark once per level, each in a
process of its own (a process has one front-end pipeline), and prints the levels side by side.
``--exporter file``: the instrumented engine writes ``OTEL_LLM_TRACES_FILE`` instead of OTLP. Each
traced process's own report of its span CPU (engine_hooks.spans.self_metrics, to the sink every second)
is printed per process: front end and engine core, per request and per step.
Each round also reads the CPU time (user + system) of this process and every engine-core process
under it before and after each engine's batch: CPU per output token, printed as plain /
instrumented (1 = free), which does not depend on what else the two shared cores were doing
at the time the way throughput does. And of this process alone, the front end (all of the
tracing's work but the engine core's step hooks runs there): what each traced engine's front end
costs over plain's, as a share of plain's whole CPU per token, which the engine core's noise does
not reach.
The medians come with a 95% bootstrap interval: on a shared machine, many short rounds
(``--rounds 40 --requests 64 --tokens 64``) narrow it more than a few long ones.
Target (docs/architecture.md, "The hot path"): instrumented/plain >= 0.99.

``--engine transformers``: the same comparison for transformers continuous batching (the tiny
model, fp32, on the CPU): a plain model and one traced by ``engine_hooks.instrument``, each with
its manager started once, the same batch in alternating rounds (benchmarks/cb_runs.py, which the
GPU check shares); prints the ratio per round and the adapter's hook cost per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent import futures

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# three engines share two cores: idle ones must not spin their OpenMP threads while another runs
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KMP_BLOCKTIME", "0")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MiB = 2**20


def tree_cpu_s(pid: int | None = None, exclude: int | None = None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (this one by default) and every
    live process under it but ``exclude`` (the sink's): what a round cost in CPU, whichever core it
    ran on. 0 for a process that has gone."""
    import psutil

    try:
        top = psutil.Process(pid)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        if p.pid == exclude:
            continue
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.Error:  # ended meanwhile
            pass
    return total


class Sink:
    """:func:`start_sink` in a process of its own: parsing what the traced engines send is the
    collector's work, not theirs, so it is kept off their CPU and out of their process's GIL.
    :meth:`report` asks it for (spans received, the tracer's cost reports)."""

    def __init__(self):
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--sink"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.port = int(self.proc.stdout.readline())
        self.pid = self.proc.pid

    def report(self) -> tuple[int, dict]:
        self.proc.stdin.write("report\n")
        self.proc.stdin.flush()
        d = json.loads(self.proc.stdout.readline())
        return d["spans"], {tuple(k): v for k, v in d["costs"]}


def serve_sink() -> None:
    """``--sink``: run :func:`start_sink`, print its port, answer each ``report`` line on stdin
    with one JSON line; end when stdin does."""
    _server, port, received = start_sink()
    print(port, flush=True)
    for line in sys.stdin:
        if line.strip() == "report":
            costs = [[list(k), v] for k, v in received[1].items()]
            print(json.dumps({"spans": count_spans(received[0]), "costs": costs}), flush=True)


def count_spans(messages: list[bytes]) -> int:
    """Spans in the ExportTraceServiceRequests the sink kept, parsed now (the count so far is
    remembered: each message is parsed once)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    while len(messages) > 1:
        request = ExportTraceServiceRequest.FromString(messages.pop())
        messages[0] += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
    return messages[0]


def start_sink() -> tuple[object, int, list]:
    """An OTLP/gRPC sink on loopback that keeps the traces' bytes unparsed (:func:`count_spans`
    counts them when asked: parsing at once would be work of the sink's that the scheduler tends
    to run on the exporting engine's core, its cost then charged to the engine being measured)
    and takes the traced processes' own metrics (engine_hooks.spans.self_metrics), which it acknowledges."""
    import grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc

    received: list = [[0]]  # [[spans counted so far, then the messages not yet counted], costs]
    costs: dict = {}  # (service, pid, pipeline) -> {metric: latest value}, from engine_hooks.spans.self_metrics
    received.append(costs)

    def export_traces(request: bytes, context) -> bytes:
        received[0].append(request)
        return b""  # an empty ExportTraceServiceResponse

    class MetricsSink(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request, context):
            for rm in request.resource_metrics:
                res = {a.key: a.value for a in rm.resource.attributes}
                who = (res["service.name"].string_value if "service.name" in res else "?", res.get("process.pid"))
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        if m.name.startswith("otel_llm.tracer.") and m.WhichOneof("data") == "sum":
                            for p in m.sum.data_points:
                                pipe = next((a.value.string_value for a in p.attributes), "")
                                key = (who[0], who[1].int_value if who[1] is not None else 0, pipe)
                                v = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                                costs.setdefault(key, {})[m.name[len("otel_llm.tracer.") :]] = v
            return metrics_service_pb2.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    traces = {"Export": grpc.unary_unary_rpc_method_handler(export_traces)}  # bytes in, bytes out
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("opentelemetry.proto.collector.trace.v1.TraceService", traces),)
    )
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(MetricsSink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, received


def export_env(port: int, exporter: str, tmp: str) -> None:
    """Point this process's traced engines (and those it starts) at the sink on ``port``:
    OTLP/gRPC, or for ``exporter`` ``file`` our spans to ``OTEL_LLM_TRACES_FILE`` in ``tmp`` (the
    tracer's own cost reports and vLLM's tracing still go to the sink)."""
    os.environ.pop("OTEL_LLM_TRACES_FILE", None)
    os.environ.update(
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRIC_EXPORT_INTERVAL="1000",  # the tracer's own cost, per process, every second
    )
    if exporter == "file":
        os.environ["OTEL_LLM_TRACES_FILE"] = os.path.join(tmp, "spans.jsonl")
        os.environ["OTEL_METRICS_EXPORTER"] = "otlp"


def make_engine(kind: str, model: str, kv_mib: int):
    """One ``vllm.LLM`` on the tiny model: ``plain``, ``instrumented`` (``engine_hooks.instrument``)
    or ``vllm-tracing`` (vLLM's own, to ``OTEL_EXPORTER_OTLP_ENDPOINT``, see :func:`export_env`)."""
    from vllm import LLM

    import engine_hooks

    common = dict(
        model=model, dtype="bfloat16", enforce_eager=True, max_model_len=512, kv_cache_memory_bytes=kv_mib * MiB
    )
    if kind == "instrumented":
        return engine_hooks.instrument(LLM)(**common)
    if kind == "vllm-tracing":
        endpoint = os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
        return LLM(**common, otlp_traces_endpoint=endpoint, disable_log_stats=False)
    return LLM(**common)


def median_interval(values: list[float], level: float = 0.95, resamples: int = 4000) -> tuple[float, float]:
    """A bootstrap interval for the median of ``values`` (percentile method, fixed seed): how far
    the median of this many noisy rounds can be trusted."""
    import random

    rng = random.Random(0)
    n = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    lo = meds[int((1 - level) / 2 * resamples)]
    hi = meds[min(int((1 + level) / 2 * resamples), resamples - 1)]
    return lo, hi


def hot_path_cost_us(n: int = 20000, batch: int = 128) -> tuple[float, float]:
    """Per-step cost of the scheduler hooks (schedule + update_from_output wrappers), timed on a
    stand-in scheduler class patched by the same code as vLLM's, with a 128-request batch."""
    from engine_hooks import EngineHooks, TracingPipeline
    from engine_hooks.vllm.core import instrument_scheduler_class

    class SO:
        def __init__(self):
            self.num_scheduled_tokens = {f"r{i}": 1 for i in range(batch)}
            self.total_num_scheduled_tokens = batch
            self.preempted_req_ids = set()

    class KV:
        usage = 0.5

    def make_scheduler_class():
        class Sched:  # what the hooks read of vLLM's Scheduler
            kv_cache_manager = KV()
            waiting = [object()] * 4  # requests left waiting: the step's wait reason is worked out
            running = [object()] * batch
            max_num_running_reqs = batch
            max_num_scheduled_tokens = 8192

            def schedule(self):
                return SO()

            def update_from_output(self, so, out):
                return {}

            def shutdown(self):
                pass

        return Sched

    Plain, Sched = make_scheduler_class(), make_scheduler_class()
    pipeline = TracingPipeline(None, capacity=1 << 30, detail="steps")  # builds the step spans it times
    instrument_scheduler_class(Sched, EngineHooks(pipeline=pipeline))

    def loop(cls):
        s = cls()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            s.update_from_output(s.schedule(), None)
        return (time.perf_counter_ns() - t0) / n / 1000

    loop(Plain), loop(Sched)
    plain = min(loop(Plain) for _ in range(3))
    hooked = min(loop(Sched) for _ in range(3))
    t0 = time.thread_time_ns()
    pipeline.process()
    build_us = (time.thread_time_ns() - t0) / (n * 4) / 1000
    return hooked - plain, build_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--model", default=None, help="model folder (default: build the tiny model in a temp dir)")
    ap.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    ap.add_argument("--detail", choices=("request", "phases", "steps", "all"), default="phases")
    ap.add_argument(
        "--exporter",
        choices=("otlp", "file"),
        default="otlp",
        help="the instrumented engine's exporter: OTLP/gRPC to a local sink (default), or OTEL_LLM_TRACES_FILE",
    )
    ap.add_argument("--sink", action="store_true", help=argparse.SUPPRESS)  # the sink's own process
    a = ap.parse_args()
    if a.sink:
        serve_sink()
        return
    if a.detail == "all":
        all_levels(a)
        return
    os.environ["OTEL_LLM_DETAIL"] = a.detail  # the front end's pipeline and the engine core's read it
    if a.engine == "transformers":
        transformers_main(a)
        return

    from vllm import SamplingParams

    import engine_hooks
    from engine_hooks.tiny_model import build_tiny_model, prompt

    tmp = tempfile.mkdtemp(prefix="otel-llm-bench-")
    model = a.model or build_tiny_model(os.path.join(tmp, "tiny"))
    sink = Sink()
    port = sink.port
    # both traced engines export over OTLP/gRPC to the same local sink, as in a deployment
    export_env(port, a.exporter, tmp)
    print(f"starting 3 engines (tiny model, {a.kv_mib} MiB KV cache)...", flush=True)
    engines = {kind: make_engine(kind, model, a.kv_mib) for kind in ("plain", "instrumented", "vllm-tracing")}
    prompts = [prompt(32, seed=i) for i in range(a.requests)]
    sp = SamplingParams(max_tokens=a.tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:8], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    rates: dict[str, list[float]] = {k: [] for k in engines}
    cpu_per_token: dict[str, list[float]] = {k: [] for k in engines}  # CPU us per output token, all processes
    fe_per_token: dict[str, list[float]] = {k: [] for k in engines}  # the same, of this (the front end's) process
    for r in range(a.rounds):
        order = list(engines.items())
        order = order[r % 3 :] + order[: r % 3]  # rotate who goes first
        for name, llm in order:
            c0 = tree_cpu_s(exclude=sink.pid)
            f0 = time.process_time()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            engine_hooks.flush()  # the instrumented engine's last spans, in its own round's CPU
            cpu = tree_cpu_s(exclude=sink.pid) - c0
            fe_cpu = time.process_time() - f0
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[name].append(toks / dt)
            cpu_per_token[name].append(cpu / toks * 1e6)
            fe_per_token[name].append(fe_cpu / toks * 1e6)
        print(
            f"round {r + 1}/{a.rounds}: "
            + ", ".join(f"{k} {v[-1]:,.0f} tok/s ({cpu_per_token[k][-1]:.1f} us CPU/token)" for k, v in rates.items()),
            flush=True,
        )
    engine_hooks.flush()
    from engine_hooks.pipeline import _live_pipelines

    fe = next(iter(_live_pipelines))
    hot_us, build_us = hot_path_cost_us()

    ratio = [i / p for i, p in zip(rates["instrumented"], rates["plain"])]
    vratio = [v / p for v, p in zip(rates["vllm-tracing"], rates["plain"])]
    print()
    print(f"requests x tokens: {a.requests} x {a.tokens}, rounds: {a.rounds}")
    for k, v in rates.items():
        print(
            f"{k:>13}: median {statistics.median(v):,.0f} output tok/s  (rounds: {', '.join(f'{x:,.0f}' for x in v)})"
        )
    lo, hi = median_interval(ratio)
    print(
        f"instrumented / plain: median {statistics.median(ratio):.3f}, 95% interval {lo:.3f}-{hi:.3f}  "
        f"(rounds: {', '.join(f'{x:.3f}' for x in ratio)})  target >= 0.99"
    )
    # all rounds together: total tokens / total time of each engine (the harmonic mean of its rates)
    total = {k: len(v) / sum(1 / x for x in v) for k, v in rates.items()}
    print(
        f"instrumented / plain, all rounds together: {total['instrumented'] / total['plain']:.3f}; "
        f"vllm-tracing / plain: {total['vllm-tracing'] / total['plain']:.3f}"
    )
    vlo, vhi = median_interval(vratio)
    print(
        f"vllm-tracing / plain: median {statistics.median(vratio):.3f}, 95% interval {vlo:.3f}-{vhi:.3f}  "
        f"(rounds: {', '.join(f'{x:.3f}' for x in vratio)})"
    )
    # CPU per output token of each engine's round (front end, its engine core, the sink's share):
    # plain / instrumented, so that like the throughput ratio 1 means free and lower costs more
    cpu_ratio = [p / i for i, p in zip(cpu_per_token["instrumented"], cpu_per_token["plain"])]
    vcpu_ratio = [p / v for v, p in zip(cpu_per_token["vllm-tracing"], cpu_per_token["plain"])]
    tot_cpu = {k: statistics.fmean(v) for k, v in cpu_per_token.items()}
    for name, rs in (("instrumented", cpu_ratio), ("vllm-tracing", vcpu_ratio)):
        clo, chi = median_interval(rs)
        print(
            f"CPU per output token, plain / {name}: median {statistics.median(rs):.3f}, "
            f"95% interval {clo:.3f}-{chi:.3f} "
            f"(rounds: {', '.join(f'{x:.3f}' for x in rs)}); all rounds {tot_cpu['plain'] / tot_cpu[name]:.3f}"
        )
    extra = (tot_cpu["instrumented"] - tot_cpu["plain"]) * a.tokens
    print(
        "CPU per output token (us, mean of rounds): "
        + ", ".join(f"{k} {v:.2f}" for k, v in tot_cpu.items())
        + f"; instrumented's extra: {extra:.0f} us per {a.tokens}-token request"
    )
    # the front end's process alone (this one): where all of the tracing's work but the engine
    # core's step hooks runs, and where the engine core's noise does not reach
    fe_med = {k: statistics.median(v) for k, v in fe_per_token.items()}
    plain_fe, plain_cpu = fe_per_token["plain"], statistics.median(cpu_per_token["plain"])
    fe_share = {  # each traced engine's front end over plain's, round by round, of plain's whole CPU per token
        k: statistics.median([x - p for x, p in zip(v, plain_fe)]) / plain_cpu
        for k, v in fe_per_token.items()
        if k != "plain"
    }
    print(
        "front-end process CPU per output token (us, median of rounds): "
        + ", ".join(f"{k} {v:.2f}" for k, v in fe_med.items())
        + "; over plain, as a share of plain's whole CPU per token: "
        + ", ".join(f"{k} {v * 100:.2f}%" for k, v in fe_share.items())
    )
    print(
        f"hook cost on the engine's thread: {hot_us:.2f} us per engine step "
        f"(schedule + update_from_output wrappers, 128-request batch)"
    )
    print(f"span building off the engine's thread: {build_us:.2f} us of CPU per step span")
    print(
        f"front-end pipeline CPU (span building and export, its own thread): "
        f"{fe.counters.cpu_ns / max(fe.counters.requests_traced, 1) / 1000:.1f} us per request"
    )
    print(
        f"front-end pipeline: {fe.counters.requests_traced} requests traced, {fe.counters.spans_exported} spans "
        f"exported, {fe.counters.spans_dropped} dropped, {fe.counters.hook_errors} hook errors; "
        f"the sink received {sink.report()[0]} spans"
        + (" from both traced engines" if a.exporter == "otlp" else " from vLLM's own tracing (ours went to the file)")
    )
    result = {
        "detail": a.detail,
        "exporter": a.exporter,
        "ratio_median": statistics.median(ratio),
        "ratio_interval": [lo, hi],
        "ratio_rounds": ratio,
        "vllm_tracing_median": statistics.median(vratio),
        "cpu_ratio_median": statistics.median(cpu_ratio),
        "cpu_ratio_rounds": cpu_ratio,
        "vllm_tracing_cpu_ratio_median": statistics.median(vcpu_ratio),
        "frontend_cpu_us_per_token": fe_med,
        "frontend_extra_share": fe_share,
        "spans_exported": fe.counters.spans_exported,
        "cpu_us_per_request": fe.counters.cpu_ns / max(fe.counters.requests_traced, 1) / 1000,
        "requests": fe.counters.requests_traced,
    }
    print("RESULT " + json.dumps(result), flush=True)
    time.sleep(2.5)  # the processes' last cost reports (every second)
    for (service, pid, pipe), v in sorted(sink.report()[1].items()):
        per = []
        if v.get("requests"):
            per.append(f"{v['cpu_time'] / v['requests'] * 1e6:.1f} us per request")
        if v.get("steps"):
            per.append(f"{v['cpu_time'] / v['steps'] * 1e6:.1f} us per step")
        print(
            f"tracer's own report, process {pid} ({service}, {pipe}): {v.get('cpu_time', 0):.3f} s of span CPU over "
            f"{v.get('requests', 0):.0f} requests and {v.get('steps', 0):.0f} steps"
            + (f": {', '.join(per)}" if per else "")
            + (
                " (the stand-in scheduler hot_path_cost_us timed, not an engine)"
                if pid == os.getpid() and pipe == "engine/engine"
                else ""
            )
        )
    # the sink stays up until the process exits: vLLM's exporter flushes at exit


def all_levels(a: argparse.Namespace) -> None:
    """The benchmark once per detail level, each in its own process; the levels side by side."""
    import subprocess

    rows = []
    for level in ("request", "phases", "steps"):
        print(f"== detail {level} ==", flush=True)
        argv = [sys.executable, __file__, "--detail", level, "--rounds", str(a.rounds), "--requests", str(a.requests)]
        argv += ["--tokens", str(a.tokens), "--kv-mib", str(a.kv_mib), "--engine", a.engine, "--exporter", a.exporter]
        if a.model:
            argv += ["--model", a.model]
        proc = subprocess.run(argv, capture_output=True, text=True)
        sys.stdout.write(proc.stdout)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"detail {level}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}")
            continue
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
    print("\n== by detail level (instrumented / plain, median of rounds; spans per request) ==")
    for r in rows:
        per = r["spans_exported"] / r["requests"] if r.get("requests") else float("nan")
        vt = r.get("vllm_tracing_median")
        print(
            f"{r['detail']:>8}: {r['ratio_median']:.3f} (rounds {', '.join(f'{x:.3f}' for x in r['ratio_rounds'])})"
            + (f"; vllm-tracing / plain {vt:.3f}" if vt is not None else "")
            + (
                f"; CPU plain / instrumented {r['cpu_ratio_median']:.3f} "
                f"(rounds {', '.join(f'{x:.3f}' for x in r['cpu_ratio_rounds'])}), "
                f"plain / vllm-tracing {r['vllm_tracing_cpu_ratio_median']:.3f}"
                if "cpu_ratio_median" in r
                else ""
            )
            + f"; {per:.1f} front-end spans and {r.get('cpu_us_per_request', float('nan')):.0f} us of front-end "
            "span CPU per request (step spans come from the engine core)"
            + (
                "; front-end process CPU over plain, of plain's CPU per token: "
                + ", ".join(f"{k} {v * 100:.2f}%" for k, v in r["frontend_extra_share"].items())
                if "frontend_extra_share" in r
                else ""
            )
        )


def transformers_main(a: argparse.Namespace) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    import cb_runs

    tiny = a.model or os.path.join(tempfile.mkdtemp(prefix="otel-llm-bench-"), "tiny")
    build = lambda: cb_runs.build_model(None, "cpu", "float32", tiny)
    model = build()
    batch = cb_runs.prompts(a.requests, 32, model.config.vocab_size)
    gen, cb = cb_runs.configs(a.tokens, a.requests, 32)
    print(f"transformers continuous batching, tiny model on the CPU: {a.requests} x {a.tokens} tokens", flush=True)
    r = cb_runs.alternate(model, cb_runs.tracing("cpu"), batch, gen, cb, a.rounds)
    hook = cb_runs.hook_cost_us(a.requests)
    rounds = lambda v: ", ".join(f"{x:,.0f}" for x in v)
    print(f"plain: median {statistics.median(r.plain):,.0f} output tok/s (rounds: {rounds(r.plain)})")
    print(f"instrumented: median {statistics.median(r.traced):,.0f} output tok/s (rounds: {rounds(r.traced)})")
    print(
        f"instrumented / plain: median {statistics.median(r.ratios):.3f} (rounds: "
        f"{', '.join(f'{x:.3f}' for x in r.ratios)}); all rounds together {r.ratio_all:.3f}  target >= 0.98"
    )
    print(
        f"hook cost on the engine's thread: {hook:.1f} us per step at {a.requests} requests; "
        f"median step {statistics.median(r.step_wall_ms):.2f} ms over {r.steps} traced steps"
    )
    print(
        "RESULT "
        + json.dumps({"detail": a.detail, "ratio_median": statistics.median(r.ratios), "ratio_rounds": r.ratios})
    )


if __name__ == "__main__":
    main()
