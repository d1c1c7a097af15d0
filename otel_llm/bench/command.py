"""``otel-llm bench``: drive an OpenAI-compatible server under stated load, traced at the client.

The command: options, their validation, the tracer provider, the run (the load generator is
:mod:`otel_llm.bench.load`), and what it writes and prints. Warm-up requests run first and are excluded.
The conditions of docs/metrics/spec.md travel with the run: as resource attributes of every client
span, on an ``llm.bench.run`` span, in the summary, and in ``--output``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
from urllib.parse import urlsplit

from .. import environment
from .. import semconv as sc
from ..cli_options import CLIError, add_analysis_options, analysis_text, check_output_path
from ..client.traced import ClientResult, TracedClient
from ..declared_options import add_options, settle
from ..metrics.timeline import TimelineBatch
from ..metrics.timeline_file import timeline_to_json
from ..otlp.export import unreachable_endpoint
from ..otlp.tracing import make_provider
from ..semconv import RequestStatus
from . import replay
from .bench_options import BenchOptions
from .bench_sweep import Sweeper, points_size, print_results, run_capacity, run_sweep
from .capacity import CapacitySearch, Sweep
from .load import BenchRun, LengthDist, LoadRunner, LoadSpec, Progress, Sent, conditions, measured


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="load an OpenAI-compatible server under stated conditions, traced at the client",
        description="Send streaming completions at a stated load (open loop: --rate; closed loop: "
        "--concurrency), record what the client saw as llm.client.request spans (W3C traceparent "
        "injected, so engine spans join), and print the client-boundary summary with the conditions.",
        epilog="Spans go where the standard OTEL_* variables say (OTEL_EXPORTER_OTLP_ENDPOINT, default "
        "http://localhost:4318 over OTLP/HTTP, where `otel-llm collector` listens; OTEL_EXPORTER_OTLP_PROTOCOL, "
        "OTEL_SERVICE_NAME) or to OTEL_LLM_TRACES_FILE; OTEL_TRACES_EXPORTER=none runs without export, and with "
        "nothing listening at the endpoint bench says so and exports nothing. Ctrl-C cancels what "
        "is in flight, counts it, still prints the summary and exits 130. A run in which no request "
        "succeeded exits 1; a bad option exits 2.",
    )
    add_options(p, BenchOptions, environment.bench_variable)
    add_analysis_options(p)
    p.set_defaults(func=cmd_bench)


def load_spec(args: argparse.Namespace) -> tuple[LoadSpec, LengthDist, LengthDist]:
    """What the options ask for, checked (CLIError: a usage error)."""
    try:
        inp, out = LengthDist.parse(args.input_tokens), LengthDist.parse(args.output_tokens)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    checks = (
        ("--rate", args.rate, "> 0", lambda v: math.isfinite(v) and v > 0),
        ("--concurrency", args.concurrency, ">= 1", lambda v: v >= 1),
        ("--num-requests", args.num_requests, ">= 1", lambda v: v >= 1),
        ("--duration", args.duration, "> 0 seconds", lambda v: math.isfinite(v) and v > 0),
        ("--burstiness", args.burstiness, "> 0 (the gamma shape)", lambda v: math.isfinite(v) and v > 0),
        ("--max-concurrency", args.max_concurrency, ">= 1", lambda v: v >= 1),
        ("--warmup", args.warmup, ">= 0", lambda v: v >= 0),
        ("--vocab-size", args.vocab_size, ">= 11 (prompt ids are drawn from 10 up)", lambda v: v >= 11),
    )
    for flag, value, want, ok in checks:
        if value is not None and not ok(value):
            raise CLIError(f"{flag} must be {want}, got {value}")
    if args.max_concurrency is not None and args.concurrency:
        raise CLIError("--max-concurrency caps an open loop (--rate); a closed loop is --concurrency alone")
    rp = None
    if args.replay:
        from ..cli_options import load_source

        try:
            rp = replay.load(
                args.replay, args.replay_format, args.replay_speed, args.replay_run, args.replay_block_size, load_source
            )
        except (OSError, ValueError) as exc:  # the file, or what is in it
            raise CLIError(f"--replay: {exc}") from None
        if args.num_requests is None and not args.duration:
            args.num_requests = len(rp.items)
        args.num_requests = None if args.num_requests is None else min(args.num_requests, len(rp.items))
    spec = LoadSpec(
        replay=rp,
        rate=args.rate,
        arrival=args.arrival,
        burstiness=args.burstiness,
        concurrency=args.concurrency,
        max_concurrency=args.max_concurrency,
        num_requests=None if args.duration else (100 if args.num_requests is None else args.num_requests),
        duration_s=args.duration,
        warmup=args.warmup,
        seed=args.seed,
        **({"run_id": args.run_id} if args.run_id else {}),
    )
    return spec, inp, out


def run_resource(args: argparse.Namespace, spec: LoadSpec, inp: LengthDist, out: LengthDist) -> dict:
    """The resource attributes of every client span: the conditions known before the run."""
    known = {
        **spec.describe(),
        "model": args.model,
        "input_tokens": inp.describe(),
        "output_tokens": out.describe(),
        "engine": args.engine,
        "hardware": args.hardware,
        "seed": args.seed,
    }
    return {**{sc.BENCH_PREFIX + k: v for k, v in known.items() if v is not None}, "service.name": "otel-llm-bench"}


def send_load(args: argparse.Namespace, spec: LoadSpec, inp: LengthDist, out: LengthDist, provider) -> BenchRun:
    """Run the load to its end, or until SIGINT / SIGTERM (which cancel what is in flight)."""

    async def main() -> BenchRun:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, stop.set)
            loop.add_signal_handler(signal.SIGTERM, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
        async with TracedClient(
            args.base_url, model=args.model, api_key=args.api_key, tracer_provider=provider
        ) as client:
            runner = LoadRunner(
                client,
                spec,
                inp,
                out,
                vocab=args.vocab_size,
                ignore_eos=not args.no_ignore_eos,
                progress=Progress(spec.num_requests, spec.duration_s),
                stop=stop,
            )
            return await runner()

    return asyncio.run(main())


def write_timelines(path: str, sent: list[Sent]) -> None:
    """Each measured request's client timeline, in the ``analyze`` input format."""
    with open(path, "w") as fh:
        for s in sent:
            d = timeline_to_json(s.result.timeline())
            d.update(trace_id=s.result.trace_id, estimated=s.result.estimated)
            if s.intended_ns is not None:
                d["intended"] = s.intended_ns / 1e9
            fh.write(json.dumps(d) + "\n")


def print_summary(args: argparse.Namespace, sent: list[Sent], cond: dict) -> None:
    batch = TimelineBatch.from_timelines([s.result.timeline() for s in sent])
    if args.format == "json":
        sys.stdout.write(analysis_text(batch, args, extra={"conditions": cond}))
    else:
        sys.stdout.write(format_conditions(cond) + "\n" + analysis_text(batch, args))
        if args.output:
            print(f"timelines written to {args.output}")
    errors = [s.result for s in sent if s.result.error and s.result.status == RequestStatus.ERROR]
    if errors:
        hint = failure_hint(args.base_url, errors[0])
        print(f"otel-llm bench: {len(errors)} requests failed; first: {errors[0].error}{hint}", file=sys.stderr)


def run_spec(args: argparse.Namespace, spec: LoadSpec, inp: LengthDist, out: LengthDist) -> tuple[BenchRun, dict]:
    """One run of ``spec`` with a tracer provider of its own (its resource: this run's conditions),
    flushed and shut down before it returns (run, conditions)."""
    provider = make_provider(run_resource(args, spec, inp, out))
    run = send_load(args, spec, inp, out, provider)
    cond = conditions(spec, run, args.model, inp, out, args.engine, args.hardware)
    record_run_span(provider, run, cond)
    provider.shutdown()  # flush the client spans and the run span
    return run, cond


def sweep_checks(args: argparse.Namespace) -> None:
    """The options a sweep or a capacity search needs, or refuses (CLIError)."""
    many = args.sweep or args.find_capacity
    if not many:
        for flag in ("results", "store"):
            if getattr(args, flag):
                raise CLIError(f"--{flag} goes with --sweep or --find-capacity")
        return
    if args.output:
        raise CLIError("--output writes one run's timelines; a sweep's points are in --results and the store")
    if args.find_capacity:
        if not args.slo:
            raise CLIError("--find-capacity needs --slo (e.g. --slo ttft=0.5,tpot=0.05)")
        if not 0 < args.attainment <= 1 or not 0 < args.attainment_error < 0.5 or not 0 < args.confidence < 1:
            raise CLIError("needs 0 < --attainment <= 1, 0 < --attainment-error < 0.5 and 0 < --confidence < 1")
        if not args.min_rate <= args.start_rate <= args.max_rate:
            raise CLIError("needs --min-rate <= --start-rate <= --max-rate")
    steady = args.find_capacity  # a search's points measure a steady state by default; a sweep's, as given
    if args.min_point_duration is None:
        args.min_point_duration = 30.0 if steady else 0.0
    if args.settle is None:
        args.settle = 0.25 if steady else 0.0
    if not 0 <= args.settle < 0.9:
        raise CLIError("needs 0 <= --settle < 0.9")


def cmd_sweep(args: argparse.Namespace, spec: LoadSpec, inp: LengthDist, out: LengthDist) -> int:
    if args.sweep:
        try:
            sweep = Sweep.parse(args.sweep)
        except ValueError as exc:
            raise CLIError(f"--sweep: {exc}") from None
        if sweep.knob == "concurrency" and args.max_concurrency is not None:
            raise CLIError("--max-concurrency caps an open loop; a concurrency sweep is closed loop")
    else:
        args.points_requests, args.points_error = points_size(args)
        if args.points_requests is not None:  # measured after the settling time
            spec.num_requests = math.ceil(args.points_requests / (1 - args.settle))
    sweeper = Sweeper(args, spec, lambda s: run_spec(args, s, inp, out))
    conclusion = None
    try:
        if args.sweep:
            conclusion = run_sweep(sweeper, sweep)
        else:
            search = CapacitySearch(
                start=args.start_rate,
                resolution=args.resolution,
                min_rate=args.min_rate,
                max_rate=args.max_rate,
                max_points=args.max_points,
                target=args.attainment,
            )
            conclusion = run_capacity(sweeper, search)
    finally:
        sweeper.close(conclusion)
    knob = sweep.knob if args.sweep else "rate"
    print_results(args, knob, sweeper.points, conclusion)
    return 130 if sweeper.interrupted else 1 if sweeper.aborted else 0


def failure_hint(base_url: str, res: ClientResult | None) -> str:
    """What to check, in words, for a request that failed the way ``res`` did ('' when nothing
    specific)."""
    if res is None:
        return ""
    if res.http_status == 404 and not urlsplit(base_url).path.rstrip("/").endswith("/v1"):
        return f" (OpenAI-compatible servers answer under /v1: try --base-url {base_url.rstrip('/')}/v1)"
    if res.http_status == 404:
        return f" (no such endpoint or model at {base_url}: check --base-url and --model)"
    if res.http_status in (401, 403):
        return " (the server wants a key: --api-key, or OPENAI_API_KEY)"
    if res.http_status is None:
        return f" (is a server listening at {base_url}?)"
    return ""


def no_collector() -> None:
    """Nothing listening where the client spans go (no collector started, the default endpoint):
    one line now, with the fix, and no export (the exporter would retry for seconds, then drop)."""
    where = unreachable_endpoint()
    if where is None:
        return
    print(
        f"otel-llm bench: nothing listens at {where} (set by OTEL_EXPORTER_OTLP_ENDPOINT; that is the default): "
        "the client spans are not exported. Start `otel-llm collector` first, or set OTEL_TRACES_EXPORTER=none.",
        file=sys.stderr,
    )
    os.environ[environment.TRACES_EXPORTER] = "none"


def settle_options(args: argparse.Namespace) -> None:
    """What the parser cannot settle (:func:`otel_llm.declared_options.settle`): the variables of
    the exclusive groups, the required options; the API key's fallback (CLIError: a usage error)."""
    try:
        settle(args, BenchOptions, environment.bench_variable)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.api_key is None:
        args.api_key = environment.raw(environment.OPENAI_API_KEY)


def cmd_bench(args: argparse.Namespace) -> int:
    settle_options(args)
    sweep_checks(args)
    check_output_path(args.output, "--output")
    check_output_path(args.results, "--results")
    if args.sweep or args.find_capacity:  # the first point's values stand in until each point sets its own
        args.rate = args.rate or args.start_rate
    spec, inp, out = load_spec(args)
    no_collector()
    if args.sweep or args.find_capacity:
        return cmd_sweep(args, spec, inp, out)
    run, cond = run_spec(args, spec, inp, out)
    ms = measured(run)
    if run.aborted:
        hint = failure_hint(args.base_url, run.first_failure)
        print(f"otel-llm bench: stopped: {run.aborted}{hint}", file=sys.stderr)
        return 1
    if args.output:
        write_timelines(args.output, ms)
    if not ms:
        raise CLIError("no request was sent")
    print_summary(args, ms, cond)
    if run.interrupted:
        return 130
    if not any(s.result.status == RequestStatus.OK for s in ms):
        counts = ", ".join(f"{v} {k}" for k, v in cond["statuses"].items() if v)
        print(f"otel-llm bench: no request succeeded ({counts})", file=sys.stderr)
        return 1
    return 0


def record_run_span(provider, run: BenchRun, cond: dict) -> None:
    """One ``llm.bench.run`` span over the measured run, carrying every condition, including what
    is only known at the end (achieved arrival rate, schedule delay, statuses)."""
    attrs = {}
    for k, v in cond.items():
        if isinstance(v, dict):
            attrs.update({f"{sc.BENCH_PREFIX}{k}.{a}": b for a, b in v.items() if b is not None})
        elif v is not None:
            attrs[sc.BENCH_PREFIX + k] = v
    span = provider.get_tracer("otel_llm.bench", "0.1.0").start_span(
        sc.SPAN_BENCH_RUN, start_time=run.start_ns, attributes=attrs
    )
    span.end(end_time=max(run.end_ns, run.start_ns))


def format_conditions(c: dict) -> str:
    lines = ["== Conditions =="]
    for k, v in c.items():
        if isinstance(v, float):
            v = f"{v:.4g}"
        elif isinstance(v, dict):
            v = ", ".join(f"{a} {b:.4g}" if isinstance(b, float) else f"{a} {b}" for a, b in v.items())
        lines.append(f"{k}: {v}")
    return "\n".join(lines) + "\n"
