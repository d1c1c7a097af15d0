"""``otel-llm bench``: drive an OpenAI-compatible server under stated load, traced at the client.

Open loop: arrivals at ``--rate`` requests/s, Poisson (default), constant, or gamma with
``--burstiness`` (shape; < 1 burstier than Poisson), optionally capped by ``--max-concurrency``.
Closed loop: ``--concurrency`` workers sending back to back. Lengths fixed or drawn
(``128``, ``uniform:64:256``, ``normal:128:32``). Prompts are token ids, so the input length is
exact; ``ignore_eos`` (vLLM) makes the output length exact. Warm-up requests run first and are
excluded. The conditions of spec/metrics.md travel with the run: as resource attributes of every
client span, in the summary, and in ``--output``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import environment
from .client import ClientResult, TracedClient
from .timeline import TimelineBatch
from .timeline_file import timeline_to_json

# -- what the run asks for ----------------------------------------------------------------------


@dataclass(frozen=True)
class LengthDist:
    kind: str  # fixed | uniform | normal
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        parts = text.strip().split(":")
        try:
            if len(parts) == 1:
                d = cls("fixed", float(int(parts[0])))
            elif parts[0] == "uniform" and len(parts) == 3:
                d = cls("uniform", float(int(parts[1])), float(int(parts[2])))
                if d.b < d.a:
                    raise ValueError
            elif parts[0] == "normal" and len(parts) == 3:
                d = cls("normal", float(parts[1]), float(parts[2]))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad length {text!r}: expected N, uniform:LO:HI or normal:MEAN:SD") from None
        if d.a < 1 and d.kind != "normal":
            raise ValueError(f"bad length {text!r}: lengths are >= 1")
        return d

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(rng.integers(int(self.a), int(self.b) + 1))
        return max(1, round(rng.normal(self.a, self.b)))

    def describe(self) -> str:
        return {
            "fixed": f"{int(self.a)}",
            "uniform": f"uniform[{int(self.a)}, {int(self.b)}]",
            "normal": f"normal(mean {self.a:g}, sd {self.b:g})",
        }[self.kind]


@dataclass
class LoadSpec:
    rate: float | None = None  # open loop, requests/s
    arrival: str = "poisson"  # poisson | constant | gamma
    burstiness: float = 1.0  # gamma shape
    concurrency: int | None = None  # closed loop
    max_concurrency: int | None = None  # cap on an open loop
    num_requests: int | None = 100
    duration_s: float | None = None
    warmup: int = 0
    seed: int = 0

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency else "open"

    def describe(self) -> dict:
        d = {"load_mode": self.mode}
        if self.mode == "open":
            d.update(arrival_process=self.arrival, nominal_rate_per_s=self.rate)
            if self.arrival == "gamma":
                d["burstiness"] = self.burstiness
            d["concurrency_cap"] = self.max_concurrency
        else:
            d["concurrency"] = self.concurrency
        return d


def arrival_offsets(spec: LoadSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """Intended send times, seconds after the start, for an open loop of ``n`` requests."""
    if n <= 0:
        return np.zeros(0)
    if spec.arrival == "constant":
        gaps = np.full(n, 1.0 / spec.rate)
    elif spec.arrival == "gamma":
        gaps = rng.gamma(spec.burstiness, 1.0 / (spec.rate * spec.burstiness), n)
    else:
        gaps = rng.exponential(1.0 / spec.rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


# -- running it ---------------------------------------------------------------------------------


@dataclass
class Sent:
    result: ClientResult
    intended_ns: int | None  # open loop: when it was meant to be sent
    warmup: bool = False


@dataclass
class BenchRun:
    sent: list[Sent] = field(default_factory=list)
    interrupted: bool = False
    start_ns: int = 0
    end_ns: int = 0


class Progress:
    def __init__(self, total: int | None, duration_s: float | None, stream=sys.stderr):
        self.total, self.duration_s, self.stream = total, duration_s, stream
        self.done = self.failed = self.in_flight = 0
        self.t0 = time.monotonic()
        self.tty = stream.isatty()
        self._last = 0.0

    def update(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < (0.2 if self.tty else 5.0):
            return
        self._last = now
        el = now - self.t0
        if self.total:
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30) + "." * (30 - int(frac * 30))
            head = f"[{bar}] {self.done}/{self.total}"
        else:
            head = f"{self.done} done, {el:.0f}/{self.duration_s:.0f} s"
        line = (
            f"bench: {head}, {self.in_flight} in flight, {self.failed} not ok, {self.done / el if el else 0:.1f} req/s"
        )
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        self.update(force=True)
        if self.tty:
            self.stream.write("\n")


async def run_load(
    client: TracedClient,
    spec: LoadSpec,
    input_len: LengthDist,
    output_len: LengthDist,
    *,
    vocab: int = 500,
    ignore_eos: bool = True,
    progress: Progress | None = None,
    stop: asyncio.Event | None = None,
) -> BenchRun:
    """Send the warm-up, then the measured load; cancels what is in flight when ``stop`` is set."""
    rng = np.random.default_rng(spec.seed)
    stop = stop or asyncio.Event()
    run = BenchRun()
    extra = {"ignore_eos": True} if ignore_eos else {}
    counter = iter(range(10**12))

    def make_request():
        n_in, n_out = input_len.sample(rng), output_len.sample(rng)
        prompt = rng.integers(10, max(vocab, 11), n_in).tolist()
        return prompt, n_out

    async def one(prompt, n_out, intended_ns, warm):
        i = next(counter)
        if progress:
            progress.in_flight += 1
        try:
            res = await client.completion(
                prompt,
                n_out,
                request_id=f"bench-{spec.seed}-{i}",
                extra=extra,
                attributes={"llm.bench.warmup": warm},
                on_cancel=lambda r: run.sent.append(Sent(r, intended_ns, warm)),
            )
        finally:
            if progress:
                progress.in_flight -= 1
        run.sent.append(Sent(res, intended_ns, warm))
        if progress and not warm:
            progress.done += 1
            progress.failed += res.status != "ok"
            progress.update()

    tasks: set[asyncio.Task] = set()

    async def spawn(coro):
        t = asyncio.create_task(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        return t

    # warm-up: a few at a time, awaited, excluded from the results
    for k in range(0, spec.warmup, 4):
        await asyncio.gather(*(one(*make_request(), None, True) for _ in range(min(4, spec.warmup - k))))
    run.start_ns = client._now()
    t0 = time.monotonic()
    deadline = t0 + spec.duration_s if spec.duration_s else None
    try:
        if spec.mode == "open":
            n = spec.num_requests if spec.num_requests else math.ceil(spec.duration_s * spec.rate * 2 + 10)
            offsets = arrival_offsets(spec, n, rng)
            cap = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None

            async def capped(prompt, n_out, intended):
                if cap is None:
                    return await one(prompt, n_out, intended, False)
                async with cap:
                    return await one(prompt, n_out, intended, False)

            for off in offsets:
                if deadline and t0 + off > deadline:
                    break
                delay = t0 + off - time.monotonic()
                if delay > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), delay)
                    except asyncio.TimeoutError:
                        pass
                if stop.is_set():
                    break
                prompt, n_out = make_request()
                await spawn(capped(prompt, n_out, run.start_ns + int(off * 1e9)))
        else:
            remaining = [spec.num_requests] if spec.num_requests else [None]

            async def worker():
                while not stop.is_set():
                    if deadline and time.monotonic() >= deadline:
                        return
                    if remaining[0] is not None:
                        if remaining[0] <= 0:
                            return
                        remaining[0] -= 1
                    await one(*make_request(), None, False)

            for _ in range(spec.concurrency):
                await spawn(worker())
        while tasks and not stop.is_set():
            await asyncio.wait(set(tasks), timeout=0.2)
    finally:
        if tasks:  # interrupted: cancel what is in flight; the client records them as cancelled
            run.interrupted = stop.is_set()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    run.end_ns = client._now()
    if progress:
        progress.close()
    return run


def measured(run: BenchRun) -> list[Sent]:
    return sorted((s for s in run.sent if not s.warmup), key=lambda s: s.result.submit_ns)


def conditions(
    spec: LoadSpec,
    run: BenchRun,
    args_model: str | None,
    input_len: LengthDist,
    output_len: LengthDist,
    engine: str,
    hardware: str,
) -> dict:
    ms = measured(run)
    sends = [s.result.submit_ns for s in ms]
    achieved = (len(sends) - 1) / ((sends[-1] - sends[0]) / 1e9) if len(sends) > 1 and sends[-1] > sends[0] else None
    delays = np.array([(s.result.submit_ns - s.intended_ns) / 1e9 for s in ms if s.intended_ns is not None])
    statuses = {st: sum(1 for s in ms if s.result.status == st) for st in ("ok", "error", "cancelled", "rejected")}
    c = {
        "model": args_model,
        "engine": engine,
        "hardware": hardware,
        "client_host": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
        "input_tokens": input_len.describe(),
        "output_tokens": output_len.describe(),
        **spec.describe(),
        "requests_sent": len(ms),
        "achieved_arrival_rate_per_s": achieved,
        "warmup_requests_excluded": sum(1 for s in run.sent if s.warmup),
        "statuses": statuses,
        "interrupted": run.interrupted,
        "seed": spec.seed,
    }
    if len(delays):
        c["schedule_delay_s"] = {
            "mean": float(delays.mean()),
            "p50": float(np.percentile(delays, 50)),
            "p99": float(np.percentile(delays, 99)),
            "max": float(delays.max()),
        }
    if spec.mode == "closed":
        c["note"] = (
            "closed loop: a slower server lowers the real arrival rate; this run is not the same load "
            "as an open loop at the nominal rate"
        )
    return c


# -- the command ----------------------------------------------------------------------------------


def register(sub) -> None:
    from .cli import add_analysis_options

    p = sub.add_parser(
        "bench",
        help="load an OpenAI-compatible server under stated conditions, traced at the client",
        description="Send streaming completions at a stated load (open loop: --rate; closed loop: "
        "--concurrency), record what the client saw as llm.client.request spans (W3C traceparent "
        "injected, so engine spans join), and print the client-boundary summary with the conditions.",
        epilog="Spans go where the standard OTEL_* variables say (OTEL_EXPORTER_OTLP_ENDPOINT, "
        "OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_SERVICE_NAME) or to OTEL_LLM_TRACES_FILE. Ctrl-C cancels what "
        "is in flight, counts it, and still prints the summary.",
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default="unknown", help="engine and version, recorded with the run")
    p.add_argument("--hardware", default="unknown", help="server hardware, recorded with the run")
    p.add_argument("--output", metavar="FILE", help="write per-request timelines (the analyze input format)")
    add_analysis_options(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from .cli import CLIError, analysis_text
    from .tracing import make_provider

    try:
        inp, out = LengthDist.parse(args.input_tokens), LengthDist.parse(args.output_tokens)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.rate is not None and args.rate <= 0:
        raise CLIError("--rate must be > 0")
    if args.concurrency is not None and args.concurrency < 1:
        raise CLIError("--concurrency must be >= 1")
    if args.max_concurrency is not None and args.concurrency:
        raise CLIError("--max-concurrency caps an open loop (--rate); a closed loop is --concurrency alone")
    spec = LoadSpec(
        rate=args.rate,
        arrival=args.arrival,
        burstiness=args.burstiness,
        concurrency=args.concurrency,
        max_concurrency=args.max_concurrency,
        num_requests=None if args.duration else (args.num_requests or 100),
        duration_s=args.duration,
        warmup=args.warmup,
        seed=args.seed,
    )
    resource = {f"llm.bench.{k}": v for k, v in spec.describe().items() if v is not None}
    resource.update(
        {
            "llm.bench.model": args.model,
            "llm.bench.input_tokens": inp.describe(),
            "llm.bench.output_tokens": out.describe(),
            "llm.bench.engine": args.engine,
            "llm.bench.hardware": args.hardware,
            "llm.bench.seed": args.seed,
            "service.name": "otel-llm-bench",
        }
    )
    provider = make_provider(resource)

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
            return await run_load(
                client,
                spec,
                inp,
                out,
                vocab=args.vocab_size,
                ignore_eos=not args.no_ignore_eos,
                progress=Progress(spec.num_requests, spec.duration_s),
                stop=stop,
            )

    run = asyncio.run(main())
    ms = measured(run)
    cond = conditions(spec, run, args.model, inp, out, args.engine, args.hardware)
    record_run_span(provider, run, cond)
    provider.shutdown()  # flush the client spans and the run span
    if args.output:
        with open(args.output, "w") as fh:
            for s in ms:
                d = timeline_to_json(s.result.timeline())
                d.update(trace_id=s.result.trace_id, estimated=s.result.estimated)
                if s.intended_ns is not None:
                    d["intended"] = s.intended_ns / 1e9
                fh.write(json.dumps(d) + "\n")
    if not ms:
        raise CLIError("no request was sent")
    batch = TimelineBatch.from_timelines([s.result.timeline() for s in ms])
    if args.format == "json":
        sys.stdout.write(analysis_text(batch, args, extra={"conditions": cond}))
    else:
        sys.stdout.write(format_conditions(cond) + "\n" + analysis_text(batch, args))
        if args.output:
            print(f"timelines written to {args.output}")
    errors = [s.result.error for s in ms if s.result.error and s.result.status == "error"]
    if errors:
        print(f"otel-llm bench: {len(errors)} requests failed; first: {errors[0]}", file=sys.stderr)
    return 130 if run.interrupted else 0


def record_run_span(provider, run: BenchRun, cond: dict) -> None:
    """One ``llm.bench.run`` span over the measured run, carrying every condition, including what
    is only known at the end (achieved arrival rate, schedule delay, statuses)."""
    attrs = {}
    for k, v in cond.items():
        if isinstance(v, dict):
            attrs.update({f"llm.bench.{k}.{a}": b for a, b in v.items() if b is not None})
        elif v is not None:
            attrs[f"llm.bench.{k}"] = v
    span = provider.get_tracer("otel_llm.bench", "0.1.0").start_span(
        "llm.bench.run", start_time=run.start_ns, attributes=attrs
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
