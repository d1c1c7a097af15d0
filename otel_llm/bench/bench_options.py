"""``otel-llm bench``'s own options, declared once: each is a command-line option and an
``OTEL_LLM_BENCH_<OPTION>`` variable (:mod:`otel_llm.declared_options`; the command line wins).
The options every summarising command shares (``--slo``, ``--format``, ...) are
:func:`otel_llm.cli_options.add_analysis_options`'. What the values must satisfy together is
checked where the run is built (:mod:`otel_llm.bench.command`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..declared_options import above, one_of, option
from .replay import FORMATS as REPLAY_FORMATS
from .replay import MOONCAKE_BLOCK

SWEEPS = "sweeps and the capacity search (--sweep, --find-capacity)"
REPLAY = "replay (--replay FILE)"
LOAD = "load"  # the mutually exclusive group of how the load is given, one of which is required
SIZE = "size"  # how long a run lasts: a count or seconds


def _rate(default: float, flag: str, what: str):
    return option(default, flag, "R", "--find-capacity: " + what, above(0), group=SWEEPS)


@dataclass
class BenchOptions:
    """Every ``otel-llm bench`` option of its own, in ``--help`` order (seconds, requests/s)."""

    base_url: str | None = option(
        None, "--base-url", "URL", "server API root, e.g. http://127.0.0.1:8000/v1", required=True
    )
    model: str | None = option(None, "--model", "NAME", "model name to request", required=True)
    api_key: str | None = option(None, "--api-key", "KEY", "bearer token (unset: $OPENAI_API_KEY)")
    rate: float | None = option(
        None, "--rate", "R", "open loop: arrivals per second", float, exclusive=LOAD, required=True
    )
    concurrency: int | None = option(
        None, "--concurrency", "N", "closed loop: workers sending back to back", int, exclusive=LOAD, required=True
    )
    sweep: str | None = option(
        None,
        "--sweep",
        "KNOB=VALUES",
        "one run per load point: rate=1,2,4,8 (open loop), concurrency=1,4,16 (closed loop) or "
        "KNOB=geom:LO:HI:N; each point has its own run id (<run-id>-rate4), warm-up and window",
        exclusive=LOAD,
        required=True,
    )
    find_capacity: bool = option(
        False,
        "--find-capacity",
        "",
        "search for the largest request rate at which --attainment of the requests sent meet --slo "
        "(docs/metrics/capacity.md): doubling until a rate fails, then bisecting to --resolution",
        exclusive=LOAD,
        required=True,
        switch=True,
    )
    replay: str | None = option(
        None,
        "--replay",
        "FILE",
        "send the arrivals and lengths recorded in FILE: a collector store, an OTLP trace file, a "
        "timelines file or a Mooncake JSONL trace (see --replay-format)",
        exclusive=LOAD,
        required=True,
    )
    arrival: str = option(
        "poisson",
        "--arrival",
        "poisson|constant|gamma",
        "open loop arrival process",
        one_of("poisson", "constant", "gamma"),
    )
    burstiness: float = option(1.0, "--burstiness", "K", "gamma shape: 1 = Poisson, < 1 burstier", float)
    max_concurrency: int | None = option(
        None, "--max-concurrency", "N", "cap on requests in flight in an open loop", int
    )
    num_requests: int | None = option(
        None, "--num-requests", "N", "measured requests (unset: 100)", int, exclusive=SIZE
    )
    duration: float | None = option(
        None, "--duration", "S", "measured seconds instead of a count", float, exclusive=SIZE
    )
    warmup: int = option(0, "--warmup", "N", "warm-up requests, sent first and excluded", int)
    input_tokens: str = option("128", "--input-tokens", "LENGTHS", "N, uniform:LO:HI or normal:MEAN:SD")
    output_tokens: str = option("128", "--output-tokens", "LENGTHS", "N, uniform:LO:HI or normal:MEAN:SD")
    vocab_size: int = option(500, "--vocab-size", "N", "prompt token ids are drawn below this", int)
    no_ignore_eos: bool = option(
        False, "--no-ignore-eos", "", "let the model stop early (unset: ignore_eos)", switch=True
    )
    seed: int = option(0, "--seed", "N", "seed of the arrival times and lengths", int)
    run_id: str | None = option(
        None,
        "--run-id",
        "ID",
        "this run's id, on every span it sends and every record derived from them (unset: UTC start "
        "time and random hex); select it later with analyze/compare --run ID",
    )
    engine: str = option("unknown", "--engine", "TEXT", "engine and version, recorded with the run")
    hardware: str = option("unknown", "--hardware", "TEXT", "server hardware, recorded with the run")
    output: str | None = option(None, "--output", "FILE", "write per-request timelines (the analyze input format)")
    # sweeps and the capacity search
    attainment: float = option(
        0.9,
        "--attainment",
        "F",
        "--find-capacity: the share of requests sent that must meet --slo",
        above(0),
        group=SWEEPS,
    )
    attainment_error: float = option(
        0.1,
        "--attainment-error",
        "E",
        "--find-capacity: requests per point are enough for the attainment to be known within +-E at "
        "--confidence (Wilson interval at the target; at 0.1: 37 requests at 0.9); --num-requests or "
        "--duration instead fix the points' size",
        above(0),
        group=SWEEPS,
    )
    min_point_duration: float | None = option(
        None,
        "--min-point-duration",
        "S",
        "each rate point sends for at least S seconds (rate x S requests where that is more than the count "
        "--attainment-error asks for): a burst that a server absorbs is not a sustained rate, and past capacity "
        "the queue grows for as long as a point lasts (unset: 30 with --find-capacity, 0 with --sweep)",
        float,
        0,
        group=SWEEPS,
    )
    settle: float | None = option(
        None,
        "--settle",
        "F",
        "the first F of each rate point's sending time is left out of its verdict (its queue settles); the "
        "rest is the measured window, over which the server must complete what it is sent (unset: 0.25 with "
        "--find-capacity, 0 with --sweep)",
        float,
        0,
        group=SWEEPS,
    )
    confidence: float = option(0.95, "--confidence", "C", "of each point's attainment interval", above(0), group=SWEEPS)
    resolution: float = option(
        0.1,
        "--resolution",
        "F",
        "--find-capacity stops once the lowest failing rate is within 1 + F of the highest passing one",
        float,
        0.001,
        group=SWEEPS,
    )
    start_rate: float = _rate(1.0, "--start-rate", "the first rate measured, requests/s")
    min_rate: float = _rate(0.05, "--min-rate", "below this the search gives up: capacity < R")
    max_rate: float = _rate(1000.0, "--max-rate", "the search goes no higher: capacity >= R")
    max_points: int = option(12, "--max-points", "N", "--find-capacity: at most N points", int, 1, group=SWEEPS)
    results: str | None = option(
        None,
        "--results",
        "FILE",
        "JSON lines: one object per point as it completes, then the conclusion",
        group=SWEEPS,
    )
    store: str | None = option(
        None,
        "--store",
        "PATH",
        "the collector's store that receives this run's spans: each point then gets the server and engine "
        "boundaries, the client TTFT in its parts and the engine's batch size, KV usage and preemptions",
        group=SWEEPS,
    )
    store_wait: float = option(
        30.0,
        "--store-wait",
        "S",
        "after each point, wait up to S seconds for the store to hold its records",
        float,
        0,
        group=SWEEPS,
    )
    # replay
    replay_format: str = option(
        "auto",
        "--replay-format",
        "|".join(REPLAY_FORMATS),
        "auto: told from the file",
        one_of(*REPLAY_FORMATS),
        group=REPLAY,
    )
    replay_speed: float = option(
        1.0, "--replay-speed", "F", "time runs F times faster than recorded", above(0), group=REPLAY
    )
    replay_run: str | None = option(
        None, "--replay-run", "ID", "from a store or a traces file: only this bench run", group=REPLAY
    )
    replay_block_size: int = option(
        MOONCAKE_BLOCK, "--replay-block-size", "N", "prompt tokens per Mooncake hash id", int, 1, group=REPLAY
    )
