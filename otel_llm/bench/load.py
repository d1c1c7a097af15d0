"""The load generator behind ``otel-llm bench``: what a run asks for, sending it, and the
conditions that must travel with its result (docs/metrics/spec.md, "Conditions").

Open loop: arrivals at a rate (requests/s), Poisson, constant, or gamma with a burstiness (shape;
< 1 burstier than Poisson), optionally capped in concurrency. Closed loop: a number of workers
sending back to back. Lengths fixed or drawn (``128``, ``uniform:64:256``, ``normal:128:32``).
Prompts are token ids, so the input length is exact; ``ignore_eos`` (vLLM) makes the output length
exact. Times: Unix ns from the client's clock; offsets in seconds.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import platform
import secrets
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .. import semconv as sc
from ..client.traced import ClientResult, TracedClient
from ..metrics.timeline import STATUSES
from ..semconv import RequestStatus
from .replay import Replay

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
    run_id: str = field(default_factory=lambda: new_run_id())  # carried by every span of the run
    replay: Replay | None = None  # arrivals and lengths from a recording (an open loop)

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency else "open"

    def describe(self) -> dict:
        d = {"run_id": self.run_id, "load_mode": self.mode}
        if self.replay is not None:
            d.update(arrival_process="replay", **self.replay.describe(), concurrency_cap=self.max_concurrency)
        elif self.mode == "open":
            d.update(arrival_process=self.arrival, nominal_rate_per_s=self.rate)
            if self.arrival == "gamma":
                d["burstiness"] = self.burstiness
            d["concurrency_cap"] = self.max_concurrency
        else:
            d["concurrency"] = self.concurrency
        return d


def new_run_id() -> str:
    """A run id people can sort and read: UTC start time and 6 random hex digits."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def arrival_offsets(spec: LoadSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """Intended send times, seconds after the start, for an open loop of ``n`` requests."""
    if n <= 0:
        return np.zeros(0)
    if spec.replay is not None:
        return spec.replay.offsets()[:n]
    if spec.arrival == "constant":
        gaps = np.full(n, 1.0 / spec.rate)
    elif spec.arrival == "gamma":
        gaps = rng.gamma(spec.burstiness, 1.0 / (spec.rate * spec.burstiness), n)
    else:
        gaps = rng.exponential(1.0 / spec.rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


# -- running it ---------------------------------------------------------------------------------


#: requests: when the first this many of a run all failed (none succeeded), the run stops
FAIL_FAST = 5


@dataclass
class Sent:
    result: ClientResult
    intended_ns: int | None  # open loop: when it was meant to be sent
    warmup: bool = False


@dataclass
class BenchRun:
    sent: list[Sent] = field(default_factory=list)
    interrupted: bool = False  # stopped by the user (Ctrl-C)
    aborted: str | None = None  # stopped because every request failed from the start (why)
    first_failure: ClientResult | None = None  # the first request that failed, when none had succeeded
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


class LoadRunner:
    """One run: the warm-up (a few at a time, awaited, excluded from the results), then the
    measured load, open or closed loop; once ``stop`` is set, what is in flight is cancelled (the
    client records it as cancelled)."""

    def __init__(
        self,
        client: TracedClient,
        spec: LoadSpec,
        input_len: LengthDist,
        output_len: LengthDist,
        *,
        vocab: int = 500,
        ignore_eos: bool = True,
        progress: Progress | None = None,
        stop: asyncio.Event | None = None,
    ):
        self.client, self.spec, self.input_len, self.output_len = client, spec, input_len, output_len
        self.vocab, self.progress = vocab, progress
        self.stop = stop or asyncio.Event()
        self.run = BenchRun()
        self._extra = {"ignore_eos": True} if ignore_eos else {}
        self._rng = np.random.default_rng(spec.seed)
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self._left = spec.num_requests  # closed loop: requests still to send (None: until the deadline)
        self._failed_from_start = 0  # requests that failed before any succeeded

    def _make_request(self, replayed: int | None = None) -> tuple[list[int], int]:
        """A prompt and an output length: drawn, or request ``replayed`` of the replay."""
        if replayed is not None:
            r = self.spec.replay
            return r.prompt(replayed, self._rng, max(self.vocab, 11)), r.items[replayed].output_tokens
        n_in, n_out = self.input_len.sample(self._rng), self.output_len.sample(self._rng)
        return self._rng.integers(10, max(self.vocab, 11), n_in).tolist(), n_out

    async def _send(self, prompt: list[int], n_out: int, intended_ns: int | None, warmup: bool) -> None:
        i, progress, sent = next(self._ids), self.progress, self.run.sent
        if progress:
            progress.in_flight += 1
        try:
            res = await self.client.completion(
                prompt,
                n_out,
                request_id=f"bench-{self.spec.seed}-{i}",
                extra=self._extra,
                attributes={sc.BENCH_WARMUP: warmup, sc.BENCH_RUN_ID: self.spec.run_id},
                on_cancel=lambda r: sent.append(Sent(r, intended_ns, warmup)),
            )
        finally:
            if progress:
                progress.in_flight -= 1
        sent.append(Sent(res, intended_ns, warmup))
        self._fail_fast(res)
        if progress and not warmup:
            progress.done += 1
            progress.failed += res.status != RequestStatus.OK
            progress.update()

    def _fail_fast(self, res: ClientResult) -> None:
        """Stop the run when its first :data:`FAIL_FAST` requests (warm-ups included) all failed and
        none succeeded: a wrong URL, model or key would otherwise fail every request of the run."""
        if self._failed_from_start < 0 or res.status in (RequestStatus.REJECTED, RequestStatus.CANCELLED):
            return
        if res.status == RequestStatus.OK:
            self._failed_from_start = -1  # one succeeded: the server works, failures are its answer
            return
        if self.run.first_failure is None:
            self.run.first_failure = res
        self._failed_from_start += 1
        if self._failed_from_start >= FAIL_FAST and not self.stop.is_set():
            first = self.run.first_failure
            self.run.aborted = f"the first {FAIL_FAST} requests failed and none succeeded; the first: {first.error}"
            self.stop.set()

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _warmup(self) -> None:
        n = self.spec.warmup
        for k in range(0, n, 4):
            if self.stop.is_set():
                return
            await asyncio.gather(*(self._send(*self._make_request(), None, True) for _ in range(min(4, n - k))))

    async def _capped(self, cap: asyncio.Semaphore | None, prompt, n_out, intended_ns) -> None:
        if cap is None:
            return await self._send(prompt, n_out, intended_ns, False)
        async with cap:
            return await self._send(prompt, n_out, intended_ns, False)

    async def _open_loop(self, t0: float, deadline: float | None) -> None:
        spec = self.spec
        if spec.num_requests:
            n = spec.num_requests
        elif spec.replay is not None:
            n = len(spec.replay.items)
        else:
            n = math.ceil(spec.duration_s * spec.rate * 2 + 10)
        cap = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
        for k, off in enumerate(arrival_offsets(spec, n, self._rng)):
            if deadline and t0 + off > deadline:
                break
            delay = t0 + off - time.monotonic()
            if delay > 0:
                try:
                    await asyncio.wait_for(self.stop.wait(), delay)
                except asyncio.TimeoutError:
                    pass
            if self.stop.is_set():
                break
            prompt, n_out = self._make_request(k if spec.replay is not None else None)
            self._spawn(self._capped(cap, prompt, n_out, self.run.start_ns + int(off * 1e9)))

    async def _closed_worker(self, deadline: float | None) -> None:
        while not self.stop.is_set():
            if deadline and time.monotonic() >= deadline:
                return
            if self._left is not None:
                if self._left <= 0:
                    return
                self._left -= 1
            await self._send(*self._make_request(), None, False)

    async def __call__(self) -> BenchRun:
        spec, run, tasks = self.spec, self.run, self._tasks
        await self._warmup()
        run.start_ns = self.client.now_ns()
        t0 = time.monotonic()
        deadline = t0 + spec.duration_s if spec.duration_s else None
        try:
            if spec.mode == "open":
                await self._open_loop(t0, deadline)
            else:
                for _ in range(spec.concurrency):
                    self._spawn(self._closed_worker(deadline))
            while tasks and not self.stop.is_set():
                await asyncio.wait(set(tasks), timeout=0.2)
        finally:
            run.interrupted = self.stop.is_set() and run.aborted is None
            if tasks:  # interrupted: cancel what is in flight; the client records them as cancelled
                for t in list(tasks):
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        run.end_ns = self.client.now_ns()
        if self.progress:
            self.progress.close()
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
    statuses = {st: sum(1 for s in ms if s.result.status == st) for st in STATUSES}
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
