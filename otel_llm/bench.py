"""``otel-llm bench``: drive an OpenAI-compatible server under stated load, traced at the client.

The command: options, their validation, the tracer provider, the run (the load generator is
:mod:`otel_llm.load`), and what it writes and prints. Warm-up requests run first and are excluded.
The conditions of docs/metrics/spec.md travel with the run: as resource attributes of every client
span, on an ``llm.bench.run`` span, in the summary, and in ``--output``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys

from . import environment
from . import semconv as sc
from .cli_options import CLIError, add_analysis_options, analysis_text
from .client import TracedClient
from .load import BenchRun, LengthDist, LoadRunner, LoadSpec, Progress, Sent, conditions, measured
from .timeline import TimelineBatch
from .timeline_file import timeline_to_json
from .tracing import make_provider


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="load an OpenAI-compatible server under stated conditions, traced at the client",
        description="Send streaming completions at a stated load (open loop: --rate; closed loop: "
        "--concurrency), record what the client saw as llm.client.request spans (W3C traceparent "
        "injected, so engine spans join), and print the client-boundary summary with the conditions.",
        epilog="Spans go where the standard OTEL_* variables say (OTEL_EXPORTER_OTLP_ENDPOINT, "
        "OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_SERVICE_NAME) or to OTEL_LLM_TRACES_FILE. Ctrl-C cancels what "
        "is in flight, counts it, still prints the summary and exits 130. A run in which no request "
        "succeeded exits 1; a bad option exits 2.",
    )
    p.add_argument("--base-url", required=True, help="server API root, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="model name to request")
    p.add_argument(
        "--api-key", default=environment.raw(environment.OPENAI_API_KEY), help="bearer token (default $OPENAI_API_KEY)"
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--rate", type=float, help="open loop: arrivals per second")
    g.add_argument("--concurrency", type=int, help="closed loop: workers sending back to back")
    p.add_argument(
        "--arrival",
        choices=("poisson", "constant", "gamma"),
        default="poisson",
        help="open loop arrival process (default poisson)",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight in an open loop")
    n = p.add_mutually_exclusive_group()
    n.add_argument("--num-requests", type=int, help="measured requests (default 100)")
    n.add_argument("--duration", type=float, help="measured seconds instead of a count")
    p.add_argument("--warmup", type=int, default=0, help="warm-up requests, sent first and excluded (default 0)")
    p.add_argument("--input-tokens", default="128", help="N, uniform:LO:HI or normal:MEAN:SD (default 128)")
    p.add_argument("--output-tokens", default="128", help="N, uniform:LO:HI or normal:MEAN:SD (default 128)")
    p.add_argument("--vocab-size", type=int, default=500, help="prompt token ids are drawn below this (default 500)")
    p.add_argument("--no-ignore-eos", action="store_true", help="let the model stop early (default: ignore_eos)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times and lengths (default 0)")
    p.add_argument(
        "--run-id",
        metavar="ID",
        help="this run's id, on every span it sends and every record derived from them (default: UTC start "
        "time and random hex); select it later with analyze/compare --run ID",
    )
    p.add_argument("--engine", default="unknown", help="engine and version, recorded with the run")
    p.add_argument("--hardware", default="unknown", help="server hardware, recorded with the run")
    p.add_argument("--output", metavar="FILE", help="write per-request timelines (the analyze input format)")
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
    spec = LoadSpec(
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
    errors = [s.result.error for s in sent if s.result.error and s.result.status == "error"]
    if errors:
        print(f"otel-llm bench: {len(errors)} requests failed; first: {errors[0]}", file=sys.stderr)


def cmd_bench(args: argparse.Namespace) -> int:
    spec, inp, out = load_spec(args)
    provider = make_provider(run_resource(args, spec, inp, out))
    run = send_load(args, spec, inp, out, provider)
    ms = measured(run)
    cond = conditions(spec, run, args.model, inp, out, args.engine, args.hardware)
    record_run_span(provider, run, cond)
    provider.shutdown()  # flush the client spans and the run span
    if args.output:
        write_timelines(args.output, ms)
    if not ms:
        raise CLIError("no request was sent")
    print_summary(args, ms, cond)
    if run.interrupted:
        return 130
    if not any(s.result.status == "ok" for s in ms):
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
