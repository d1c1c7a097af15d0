"""Benchmark: what tracing costs vLLM, in instructions counted by callgrind, per process.

Wall-clock ratios on these shared machines drift by more than the budget (docs/architecture.md,
"The hot path"); an instruction count does not. Each variant's engine runs under
``valgrind --tool=callgrind`` with counting off; after warm-up batches, the count is switched on in
every process of the engine (``callgrind_control``) for one batch, then read and switched off
again, ``--repeat`` times. The batch is fixed: ``--requests`` prompts of 32 tokens, greedy,
``--tokens`` output tokens each with ``ignore_eos``, all waiting before the first step (the
scheduler is paused while they are added), so every run takes the same steps.

Pinned in every variant alike (``benchmarks/cost_site/sitecustomize.py``): vLLM's shared-memory
queues block at once instead of spinning for a second of wall clock (which callgrind slows about
50-fold); the span thread's timer is set out of reach (``OTEL_LLM_SCHEDULE_DELAY``, and
``OTEL_BSP_SCHEDULE_DELAY`` for vLLM's own tracing) and the round it would run (build the batch's
spans and export them) runs at the end of each counted batch instead, in the front end and, by a
utility call, in the engine core, so it is counted once; behind the server, uvicorn's 0.1 s tick,
vLLM's watchdog and its stats log line do not run on the wall clock; before each batch, outside
the count, the front end's heap is collected and the batch counts only the youngest generation's
collections (an older one's fell in or out of a batch by timing).

Processes: ``front end`` (this driver, vLLM's ``OutputProcessor``, our span thread), ``engine
core`` (scheduler, our step hook), ``worker`` (the model). Prints, per variant, the instructions
of each process per batch (median of the repeats, and the spread: (max - min) / median), then
what each traced variant adds over plain (a speculative variant: over ``spec-plain``, the same
engine decoding speculatively with n-gram drafts, untraced): front end per request and per output
token, engine core per step, and the share of plain's total.

Run: ``.venv/bin/python benchmarks/cost_count.py [--variants plain,phases] [--repeat 3]``; ``make
cost`` runs every variant (``--variants all``). Two engines starting at once under
valgrind on two cores take about four and a half minutes, a counted batch of 16 x 32 about 40 s
(measured); ``--jobs`` runs variants side by side. vLLM's OpenMP binding is off
(``VLLM_CPU_OMP_THREADS_BIND=nobind``): it pins every engine's worker to core 0.
``--check``: exit 1 when a variant's total varies by more than ``--max-spread`` (0.2%) between its
identical batches; ``--check-budget``: exit 1 when the default level exceeds the budget.
Needs valgrind (Debian's package; ``make cost`` installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from engine_hooks.tiny_model import stop_cpu_server  # noqa: E402  (stops a process group whole)

#: n-gram speculative decoding (prompt lookup), for the speculative variants
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
#: variant -> how its engine is built (``traced``: None, ``ours`` or ``vllm``), its environment,
#: whether it exports over OTLP/gRPC to the run's sink (else ours write OTEL_LLM_TRACES_FILE),
#: whether it decodes speculatively (``spec``), and the untraced variant it is measured against
#: (``baseline``, default plain)
VARIANTS: dict[str, dict] = {
    "plain": {"traced": None},
    "request": {"traced": "ours", "env": {"OTEL_LLM_DETAIL": "request"}},
    "phases": {"traced": "ours", "env": {"OTEL_LLM_DETAIL": "phases"}},
    "steps": {"traced": "ours", "env": {"OTEL_LLM_DETAIL": "steps"}},
    "phases-otlp": {"traced": "ours", "env": {"OTEL_LLM_DETAIL": "phases"}, "otlp": True},
    "vllm-tracing": {"traced": "vllm", "otlp": True},
    "spec-plain": {"traced": None, "spec": True},
    "spec-phases": {"traced": "ours", "env": {"OTEL_LLM_DETAIL": "phases"}, "spec": True, "baseline": "spec-plain"},
    "spec-steps": {"traced": "ours", "env": {"OTEL_LLM_DETAIL": "steps"}, "spec": True, "baseline": "spec-plain"},
}
DEFAULT_VARIANT = "phases"  # the default detail level, to the file exporter
PROCESS_NAMES = ("front end", "engine core", "worker")  # the engine's own processes
#: otel-llm's span processes (beside the front end and the engine core), outside the engine's own
SPAN_PROCESSES = "span processes"
#: every engine started (each leads a process group of its own, out of the terminal's reach):
#: killed whole when the run ends early (Ctrl-C, SIGTERM), so no engine under valgrind outlives it
_engines: list[subprocess.Popen] = []


# -- the engine's side: runs under valgrind ------------------------------------------------------
def drive(args: argparse.Namespace) -> None:
    """Build the variant's engine, warm it up, then run one measured batch per GO read on stdin,
    printing READY / DONE lines for the parent."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import sitecustomize  # benchmarks/cost_site: flush_spans
    from vllm import LLM, SamplingParams

    from engine_hooks.tiny_model import prompt

    variant = VARIANTS[args.variant]
    kwargs = dict(
        model=args.model,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_bytes=256 * 2**20,
        seed=0,
    )
    cls = LLM
    if variant.get("spec"):
        kwargs["speculative_config"] = dict(NGRAM)
    if variant["traced"] == "ours":
        from engine_hooks import instrument

        cls = instrument(LLM)
    elif variant["traced"] == "vllm":
        kwargs["otlp_traces_endpoint"] = args.otlp_endpoint
        kwargs["disable_log_stats"] = False  # vLLM's tracing reads its statistics
    llm = cls(**kwargs)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
    prompts = [prompt(32, seed=i) for i in range(args.requests)]
    batch = 0

    def run_batch() -> None:
        nonlocal batch
        batch += 1
        core = engine.engine_core
        core.call_utility("pause_scheduler", "keep", False)  # every request waits for the first step
        for i, p in enumerate(prompts):
            engine.add_request(f"b{batch}-{i}", p, params)
        core.call_utility("resume_scheduler")
        while engine.has_unfinished_requests():
            engine.step()

    def flush() -> int:
        """This process's span round, then the engine core's; the engine steps since the last."""
        sitecustomize.flush_spans()
        return engine.engine_core.call_utility("otel_llm_flush_spans")

    for _ in range(args.warmup):
        run_batch()
    flush()  # the warm-up's spans are not the counted batch's work
    print(f"READY {os.getpid()}", flush=True)
    for line in sys.stdin:
        if line.strip() == "PREP":  # before counting starts
            sitecustomize.settle_heap()
            print("PREPARED", flush=True)
            continue
        if line.strip() != "GO":
            break
        run_batch()
        print(f"DONE {flush()}", flush=True)


# -- the parent: starts each variant under valgrind and reads the counts -------------------------
@dataclass
class Counts:
    """Instructions of one variant's processes, one list entry per measured batch."""

    variant: str
    steps: list[int] = field(default_factory=list)
    by_process: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in (*PROCESS_NAMES, SPAN_PROCESSES)})

    def values(self, process: str | None = None) -> list[int]:
        """One process's count per batch; the engine's own processes together for None."""
        if process is None:
            return [sum(batch) for batch in zip(*(self.by_process[p] for p in PROCESS_NAMES), strict=True)]
        return self.by_process[process]

    def median(self, process: str | None = None) -> float:
        return statistics.median(self.values(process))

    def spread(self, process: str | None = None) -> float:
        """(max - min) / median of the repeats: 0 when identical."""
        vals = self.values(process)
        m = statistics.median(vals)
        return (max(vals) - min(vals)) / m if m else 0.0


def _roles(driver_pid: int) -> dict[str, int]:
    """The engine's processes under valgrind, by role: the engine core is the driver's child, the
    worker the engine core's (valgrind hides the titles vLLM gives them; multiprocessing's
    resource trackers run without valgrind); a span process (otel-llm's, beside the front end or
    the engine core: ``--otel-llm-span-process`` on its command line) is the ``span process`` of
    its parent's role."""
    import psutil

    from engine_hooks.span_process.parent import SPAN_PROCESS_ARG

    def valgrind_children(pid: int) -> tuple[list[int], list[int]]:
        """(the engine's children, span processes) of ``pid`` running under valgrind."""
        try:
            kids = [k for k in psutil.Process(pid).children() if "callgrind" in k.exe()]
        except psutil.NoSuchProcess:
            return [], []
        spans = [k.pid for k in kids if SPAN_PROCESS_ARG in k.cmdline()]
        return [k.pid for k in kids if k.pid not in spans], spans

    roles = {"front end": driver_pid}
    cores, spans = valgrind_children(driver_pid)
    if len(spans) == 1:
        roles["front end's span process"] = spans[0]
    if len(cores) == 1:
        roles["engine core"] = cores[0]
        workers, spans = valgrind_children(cores[0])
        if len(spans) == 1:
            roles["engine core's span process"] = spans[0]
        if len(workers) == 1:
            roles["worker"] = workers[0]
    return roles


def _control(*args: str) -> None:
    out = subprocess.run(["callgrind_control", *args], capture_output=True, text=True)
    if out.returncode != 0 or "OK" not in out.stdout:
        raise RuntimeError(f"callgrind_control {' '.join(args)}: {out.stdout.strip()} {out.stderr.strip()}")


def _total(path: str) -> int:
    """Instructions in one callgrind dump (its ``totals:`` line; ``summary:`` counts from start)."""
    with open(path) as f:
        for line in f:
            if line.startswith("totals:"):
                return int(line.split()[1])
    raise RuntimeError(f"{path}: no totals line")


def _read_line(proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    """The driver's next line starting with ``prefix``; its whole process group is killed when none
    comes within ``timeout`` seconds (a read does not time out by itself)."""
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        for line in iter(proc.stdout.readline, ""):
            if line.startswith(prefix):
                return line
    finally:
        timer.cancel()
    if timed_out.is_set():
        raise RuntimeError(f"no {prefix} from the engine in {timeout:.0f} s: stopped")
    raise RuntimeError(f"the engine exited (code {proc.wait()}) before {prefix}")


def _variant_env(variant: str, out_dir: str, otlp_endpoint: str | None) -> dict:
    """The environment a variant's engine runs in (offline and server alike)."""
    spec = VARIANTS[variant]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "VLLM_"))}
    env.update(spec.get("env", {}))
    if spec.get("otlp"):
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{otlp_endpoint}", OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    else:
        env["OTEL_LLM_TRACES_FILE"] = os.path.join(out_dir, "spans.jsonl")
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(HERE, "cost_site"), ROOT, env.get("PYTHONPATH")])),
        OTEL_LLM_COST_COUNT="1",
        OTEL_LLM_SCHEDULE_DELAY=str(10**9),  # the span round runs at the end of each batch, counted
        OTEL_BSP_SCHEDULE_DELAY=str(10**9),  # vLLM's own tracing: likewise
        OTEL_METRIC_EXPORT_INTERVAL=str(10**9),
        VLLM_LOG_STATS_INTERVAL=str(10**9),  # the server's stats log line, every 10 s of wall clock
        OMP_NUM_THREADS="1",
        # the same string hashes in every process of every variant: set and dict work that depends
        # on them is the same in plain and traced (a random seed moved one engine core by 0.3%)
        PYTHONHASHSEED="0",
        HF_HUB_OFFLINE="1",
        VLLM_LOGGING_LEVEL="WARNING",
        # the server mode's control routes are not the load: no HTTP server span for them
        OTEL_PYTHON_ASGI_EXCLUDED_URLS="^/otel-llm/,^/health$",
    )
    # vLLM's CPU worker binds its OpenMP threads by default ("auto": core 0 of a 2-core machine,
    # the other left to the rest): two engines counted at once, or beside a test run, then share
    # core 0 while core 1 idles (an engine's start took 323 s instead of 208). Where a thread runs
    # changes no instruction; one thread each, as "auto" gives on two cores.
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def _valgrind(out_dir: str) -> list[str]:
    return [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--trace-children=yes",
        "--trace-children-skip=/usr/bin/*,/bin/*",
        "--trace-children-skip-by-arg=*resource_tracker*",
        f"--callgrind-out-file={out_dir}/cg.%p",
        "--log-file=" + os.path.join(out_dir, "valgrind.%p.log"),
    ]


def measure(variant: str, args: argparse.Namespace, workdir: str, otlp_endpoint: str | None) -> Counts:
    """Start ``variant``'s engine under callgrind (offline: this script's driver; server: vLLM's
    API server) and count ``args.repeat`` batches."""
    out_dir = os.path.join(workdir, f"{args.mode}-{variant}")
    os.makedirs(out_dir, exist_ok=True)
    env = _variant_env(variant, out_dir, otlp_endpoint)
    if args.mode == "server":
        return _measure_server(variant, args, out_dir, env, otlp_endpoint)
    cmd = [*_valgrind(out_dir), sys.executable, os.path.abspath(__file__), "--drive", variant, "--model", args.model]
    cmd += ["--requests", str(args.requests), "--tokens", str(args.tokens), "--warmup", str(args.warmup)]
    if VARIANTS[variant].get("otlp"):
        cmd += ["--otlp-endpoint", otlp_endpoint]
    t0 = time.monotonic()
    with open(os.path.join(out_dir, "engine.log"), "w") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            process_group=0,  # killed whole: no engine core or worker outlives a failed count
        )
    _engines.append(proc)

    def prepare() -> None:
        proc.stdin.write("PREP\n")
        proc.stdin.flush()
        _read_line(proc, "PREPARED", args.batch_timeout)

    def batch() -> tuple[int, str]:
        proc.stdin.write("GO\n")
        proc.stdin.flush()
        return int(_read_line(proc, "DONE", args.batch_timeout).split()[1]), ""

    try:
        driver = int(_read_line(proc, "READY", args.start_timeout).split()[1])
        return _count(variant, args, out_dir, driver, prepare, batch, t0)
    finally:
        try:
            proc.stdin.close()  # the driver's end: it shuts its engine down
        except OSError:
            pass
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        stop_cpu_server(proc, 60)  # then SIGKILL to the whole group, should anything be left


def _count(variant: str, args: argparse.Namespace, out_dir: str, front_pid: int, prepare, batch, t0: float) -> Counts:
    """Count ``args.repeat`` calls of ``batch()`` (which runs one batch and returns the engine
    steps it took, and a note for the progress line) in every process of the engine under
    ``front_pid``; ``prepare()`` runs before each, uncounted (the front end's heap settled:
    ``cost_site/sitecustomize.py``, ``settle_heap``)."""
    counts = Counts(variant)
    roles = _roles(front_pid)
    missing = set(PROCESS_NAMES) - set(roles)
    if missing:
        raise RuntimeError(f"{variant}: no {', '.join(sorted(missing))} process found under valgrind")
    label = f"{args.mode} {variant}"
    print(f"  {label}: engine up in {time.monotonic() - t0:.0f} s (pids {roles})", file=sys.stderr, flush=True)
    for r in range(args.repeat):
        prepare()
        for pid in roles.values():
            _control("-z", str(pid))
            _control("-i", "on", str(pid))
        t_go = time.monotonic()
        steps, note = batch()
        t_batch = time.monotonic()
        for pid in roles.values():
            _control("-i", "off", str(pid))
        before = set(os.listdir(out_dir))
        for pid in roles.values():
            _control("-d", str(pid))
        dumps = sorted(set(os.listdir(out_dir)) - before)
        counts.steps.append(steps)
        one = dict.fromkeys(counts.by_process, 0)
        for role, pid in roles.items():
            mine = [d for d in dumps if d.startswith(f"cg.{pid}.")]
            if len(mine) != 1:
                raise RuntimeError(f"{variant}: expected one dump of pid {pid}, found {mine}")
            one[role if role in PROCESS_NAMES else SPAN_PROCESSES] += _total(os.path.join(out_dir, mine[0]))
        for role, n in one.items():
            counts.by_process[role].append(n)
        print(
            f"  {label}: batch {r + 1}/{args.repeat}: {steps} steps, {sum(one.values()) / 1e6:,.1f} M instructions "
            f"({t_batch - t_go:.0f} s{note})",
            file=sys.stderr,
            flush=True,
        )
    return counts


# -- the server mode: vLLM's API server under valgrind, loaded over HTTP from here ----------------
def _http(method: str, url: str, timeout: float, body: dict | None = None) -> dict:
    import urllib.request

    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def _server_prepare(base: str, args: argparse.Namespace) -> None:
    """Before a batch, uncounted: pause the scheduler, and settle the front end's heap."""
    _http("POST", f"{base}/otel-llm/pause", args.batch_timeout)


def _server_batch(base: str, args: argparse.Namespace, batch_no: int) -> tuple[int, str]:
    """One batch through the API server, as the offline driver runs it: the scheduler paused (by
    :func:`_server_prepare`) while every request arrives (streamed completions of the offline
    batch's prompts, greedy, ``ignore_eos``), then resumed; every stream read to its end; then
    the span rounds. Returns the engine steps it took and the SSE events received (vLLM merges
    the outputs a stream has not taken yet into one event: fewer events than tokens means the
    server sent less)."""
    import httpx

    from engine_hooks.tiny_model import prompt

    timeout = args.batch_timeout
    errors: list[str] = []
    events = [0] * args.requests

    def one(i: int) -> None:
        body = {
            "model": args.model,
            "prompt": prompt(32, seed=i),
            "max_tokens": args.tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=timeout) as resp:
                for line in resp.iter_lines():
                    events[i] += line.startswith("data:")
                if resp.status_code != 200:
                    errors.append(f"HTTP {resp.status_code}")
        except httpx.HTTPError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(args.requests)]
    for t in threads:
        t.start()
    _http("GET", f"{base}/otel-llm/wait?n={args.requests}", timeout)
    _http("POST", f"{base}/otel-llm/resume", timeout)
    for t in threads:
        t.join(timeout)
    if errors:
        raise RuntimeError(f"batch {batch_no}: {len(errors)} requests failed ({errors[0]})")
    steps = int(_http("POST", f"{base}/otel-llm/flush", timeout)["steps"])
    return steps, f", {sum(events)} SSE events for {args.requests * args.tokens} tokens"


def _measure_server(variant: str, args: argparse.Namespace, out_dir: str, env: dict, otlp_endpoint) -> Counts:
    from engine_hooks.tiny_model import cpu_server_command, free_port

    spec = VARIANTS[variant]
    if spec["traced"] == "ours":
        env["OTEL_LLM_ENABLE"] = "1"
    port = free_port()
    extra = ["--seed", "0"]
    if spec["traced"] == "vllm":
        extra += ["--otlp-traces-endpoint", otlp_endpoint]
    if spec.get("spec"):
        extra += ["--speculative-config", json.dumps(NGRAM)]
    cmd = [*_valgrind(out_dir), *cpu_server_command(args.model, port, 256 * 2**20, extra_args=extra)]
    t0 = time.monotonic()
    with open(os.path.join(out_dir, "engine.log"), "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0)
    _engines.append(proc)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{variant}: the server exited with {proc.returncode} before it was healthy")
            try:
                _http("GET", f"{base}/health", 5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{variant}: the server was not healthy in {args.start_timeout:.0f} s") from None
                time.sleep(2)
        for w in range(args.warmup):
            _server_prepare(base, args)
            _server_batch(base, args, -w)
        batches = iter(range(1, args.repeat + 1))

        def batch() -> tuple[int, str]:
            return _server_batch(base, args, next(batches))

        return _count(variant, args, out_dir, proc.pid, lambda: _server_prepare(base, args), batch, t0)
    finally:
        stop_cpu_server(proc, 120)


#: the budget (docs/architecture.md, "The hot path"), for the default detail level
BUDGET_SHARE = 0.005  # of plain's instructions, in the engine's own processes
BUDGET_FRONT_END_PER_TOKEN = 3_000  # instructions per output token in the front end


@dataclass
class Added:
    """What one traced variant adds over plain, per batch (instructions)."""

    front_end: float
    engine_core: float
    worker: float
    share: float  # of plain's total
    per_request: float  # front end
    per_token: float  # front end
    per_step: float  # engine core


def added(c: Counts, plain: Counts, requests: int, tokens: int) -> Added:
    fe = c.median("front end") - plain.median("front end")
    ec = c.median("engine core") - plain.median("engine core")
    wk = c.median("worker") - plain.median("worker")
    return Added(
        fe,
        ec,
        wk,
        (c.median() - plain.median()) / plain.median(),
        fe / requests,
        fe / (requests * tokens),
        ec / statistics.median(plain.steps),
    )


def table(results: dict[str, Counts], requests: int, tokens: int) -> str:
    """The per-process counts and what each traced variant adds over plain."""
    lines = ["instructions per batch (median of the repeats, and their spread: (max - min) / median):", ""]
    heads = (*PROCESS_NAMES, "engine total", SPAN_PROCESSES)
    lines += [f"| variant | steps | {' | '.join(heads)} |", "|" + "---|" * (len(heads) + 2)]
    for name, c in results.items():
        cells = [f"{c.median(p) / 1e6:,.1f} M ±{c.spread(p):.2%}" for p in (*PROCESS_NAMES, None)]
        cells.append(f"{c.median(SPAN_PROCESSES) / 1e6:,.1f} M" if c.median(SPAN_PROCESSES) else "none")
        lines.append(f"| {name} | {statistics.median(c.steps):.0f} | {' | '.join(cells)} |")
    bases = {VARIANTS.get(n, {}).get("baseline", "plain") for n in results if VARIANTS.get(n, {}).get("traced")}
    bases &= set(results)
    if not bases:
        return "\n".join(lines)
    for b in sorted(bases):
        shares = ", ".join(f"{p} {results[b].median(p) / results[b].median():.1%}" for p in PROCESS_NAMES)
        lines += ["", f"{b}: {shares}"]
    lines += [
        "",
        "what tracing adds over plain (k = 1,000 instructions):",
        "",
        "| variant | front end per request | front end per token | engine core per step | worker | share of plain "
        "| outside the engine (span processes) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in results.items():
        base_name = VARIANTS.get(name, {}).get("baseline", "plain")
        base = results.get(base_name)
        if VARIANTS.get(name, {}).get("traced") is not None and base is not None:
            a = added(c, base, requests, tokens)
            outside = c.median(SPAN_PROCESSES)
            label = name if base_name == "plain" else f"{name} (over {base_name})"
            lines.append(
                f"| {label} | {a.per_request / 1e3:,.1f} k | {a.per_token / 1e3:,.1f} k | {a.per_step / 1e3:,.1f} k | "
                f"{a.worker / base.median('worker'):+.2%} | {a.share:+.2%} | "
                + (f"{outside / 1e6:,.1f} M ({outside / base.median():.2%} of {base_name})" if outside else "none")
                + " |"
            )
    return "\n".join(lines)


def budget(results: dict[str, Counts], requests: int, tokens: int) -> list[str]:
    """The budget's lines for the default variant, each ending in ok or EXCEEDED; [] without it."""
    if "plain" not in results or DEFAULT_VARIANT not in results:
        return []
    a = added(results[DEFAULT_VARIANT], results["plain"], requests, tokens)
    out = [
        (f"share of plain's instructions {a.share:+.2%} (at most {BUDGET_SHARE:.1%})", a.share <= BUDGET_SHARE),
        (
            f"front end per output token {a.per_token:,.0f} (at most {BUDGET_FRONT_END_PER_TOKEN:,})",
            a.per_token <= BUDGET_FRONT_END_PER_TOKEN,
        ),
    ]
    if "vllm-tracing" in results:
        own = results["vllm-tracing"]
        stats = added(own, results["plain"], requests, tokens)
        out.append(
            (
                f"engine core per step {a.per_step:,.0f}, vLLM's statistics and tracing {stats.per_step:,.0f} (less)",
                a.per_step < stats.per_step,
            )
        )
        outside = results[DEFAULT_VARIANT].median(SPAN_PROCESSES)
        inside = own.median() - results["plain"].median()
        out.append(
            (
                f"outside the engine's processes {outside / 1e6:,.1f} M, vLLM's own tracing inside vLLM "
                f"{inside / 1e6:,.1f} M (no more)",
                outside <= inside,
            )
        )
    return [f"budget ({DEFAULT_VARIANT}): {text}: {'ok' if ok else 'EXCEEDED'}" for text, ok in out]


def _sink() -> tuple[subprocess.Popen, str]:
    """benchmarks/overhead.py's OTLP/gRPC sink, in a process of its own (not counted)."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "overhead.py"), "--sink"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, f"127.0.0.1:{int(proc.stdout.readline())}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--variants", default=f"plain,{DEFAULT_VARIANT}", help=f"comma-separated, of {', '.join(VARIANTS)}; or all"
    )
    ap.add_argument(
        "--mode",
        choices=("offline", "server", "both"),
        default="offline",
        help="offline: vllm.LLM driven by this script; server: vLLM's OpenAI API server, the batch sent "
        "over HTTP (streamed completions); both: one after the other (default offline)",
    )
    ap.add_argument("--requests", type=int, default=32, help="requests per batch (default 32)")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request (default 64)")
    ap.add_argument("--repeat", type=int, default=3, help="counted batches per variant (default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="batches before counting starts (default 2)")
    ap.add_argument("--jobs", type=int, default=2, help="variants counted at once (default 2; counts do not change)")
    ap.add_argument(
        "--starts",
        type=int,
        default=1,
        help="engine starts per variant (default 1), their batches pooled: the figures are medians over every "
        "start's batches and the spreads span the starts (behind the server a start's batches agree within "
        "0.2%% but its front end moves by up to 1%% between starts; each start's own figures are printed too)",
    )
    ap.add_argument("--model", default=None, help="model folder (default: the tiny model, built once)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a total's spread exceeds --max-spread")
    ap.add_argument("--max-spread", type=float, default=0.002, help="for --check (default 0.002: 0.2%%)")
    ap.add_argument("--check-budget", action="store_true", help="exit 1 when the default level exceeds the budget")
    ap.add_argument("--json", help="write the counts here")
    ap.add_argument("--keep", metavar="DIR", help="keep callgrind's files and the engines' logs in DIR")
    ap.add_argument("--start-timeout", type=float, default=1800, help="seconds for an engine to start (default 1800)")
    ap.add_argument("--batch-timeout", type=float, default=1800, help="seconds for one batch (default 1800)")
    ap.add_argument("--drive", help=argparse.SUPPRESS)
    ap.add_argument("--otlp-endpoint", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.drive:
        args.variant = args.drive
        drive(args)
        return 0
    names = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        print("cost_count: valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    if args.model is None:
        from engine_hooks.tiny_model import build_tiny_model

        args.model = build_tiny_model(os.path.join(tempfile.gettempdir(), "otel-llm-tiny-model"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # cleaned up as Ctrl-C is
    sink, endpoint = _sink() if any(VARIANTS[n].get("otlp") for n in names) else (None, None)
    modes = ["offline", "server"] if args.mode == "both" else [args.mode]
    print(
        f"cost_count: {', '.join(names)} ({', '.join(modes)}): {args.requests} requests x {args.tokens} tokens a "
        f"batch, {args.warmup} warm-up and {args.repeat} counted batches each, {args.jobs} at once (an engine takes "
        "minutes to start under valgrind)",
        file=sys.stderr,
        flush=True,
    )
    by_mode: dict[str, dict[str, Counts]] = {}
    status = 0
    try:
        with tempfile.TemporaryDirectory(prefix="cost-count-") as tmp:
            workdir = args.keep or tmp
            for mode in modes:
                results, failed = _run_starts(mode, names, args, workdir, endpoint)
                by_mode[mode] = results
                for n, why in failed.items():
                    print(
                        f"cost_count: {mode} {n} failed ({why}); its engine's log: --keep DIR/{mode}-{n}/engine.log",
                        file=sys.stderr,
                    )
                    status = 1
    finally:
        if sink is not None:
            sink.kill()
    if not any(by_mode.values()):
        return 1
    for mode, results in by_mode.items():
        if not results:
            continue
        print(
            f"cost_count ({mode}): {args.requests} requests x {args.tokens} tokens a batch, {args.repeat} counted each"
        )
        print(table(results, args.requests, args.tokens))
        lines = budget(results, args.requests, args.tokens)
        print("\n".join(["", *(f"{mode} {line}" for line in lines), ""]))
        if args.check_budget and any(line.endswith("EXCEEDED") for line in lines):
            status = 1
        if args.check:
            worst, name = max((c.spread(), k) for k, c in results.items())
            if worst > args.max_spread:
                print(
                    f"cost_count: {mode} {name}'s total varies by {worst:.3%} between identical batches "
                    f"(at most {args.max_spread:.2%})"
                )
                status = 1
    if args.json:
        with open(args.json, "w") as f:
            doc = {
                mode: {k: {"steps": c.steps, "by_process": c.by_process} for k, c in results.items()}
                for mode, results in by_mode.items()
            }
            json.dump(doc, f, indent=1)
    return status


def _run_starts(mode: str, names: list[str], args: argparse.Namespace, workdir: str, endpoint) -> tuple[dict, dict]:
    """``args.starts`` engine starts of every variant in ``mode``, their batches pooled (each
    start's files under ``start-N`` where there are several): (results, failures)."""
    if args.starts <= 1:
        return _run_mode(mode, names, args, workdir, endpoint)
    pooled: dict[str, Counts] = {}
    failed: dict[str, str] = {}
    for s in range(1, args.starts + 1):
        where = os.path.join(workdir, f"start-{s}")
        os.makedirs(where, exist_ok=True)
        results, why = _run_mode(mode, names, args, where, endpoint)
        failed.update({n: f"start {s}: {w}" for n, w in why.items()})
        for n, c in results.items():
            into = pooled.setdefault(n, Counts(n))
            into.steps += c.steps
            for p, vals in c.by_process.items():
                into.by_process[p] += vals
        if "plain" in results and DEFAULT_VARIANT in results:
            a = added(results[DEFAULT_VARIANT], results["plain"], args.requests, args.tokens)
            print(
                f"  {mode} start {s}/{args.starts}: {DEFAULT_VARIANT} front end per output token {a.per_token:,.0f}, "
                f"share {a.share:+.2%}",
                file=sys.stderr,
                flush=True,
            )
    return pooled, failed


def _run_mode(mode: str, names: list[str], args: argparse.Namespace, workdir: str, endpoint) -> tuple[dict, dict]:
    """Every variant counted in ``mode``, ``args.jobs`` at once: (results, failures)."""
    margs = argparse.Namespace(**{**vars(args), "mode": mode})
    results, failed = {}, {}
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {n: pool.submit(measure, n, margs, workdir, endpoint) for n in names}
        try:
            for n, f in futures.items():
                try:
                    results[n] = f.result()
                except Exception as exc:  # the others' counts still stand
                    failed[n] = f"{type(exc).__name__}: {exc}"
        except BaseException:  # interrupted: stop every engine, so the pool's threads end
            for f in futures.values():
                f.cancel()
            for proc in _engines:
                stop_cpu_server(proc, 0)
            raise
    return results, failed


if __name__ == "__main__":
    sys.exit(main())
