"""``otel-llm collector``: run the collector until SIGINT / SIGTERM (which flush to the store)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from .assembly import AssemblyConfig
from .config import CollectorConfig, env_default, parse_slos


def _off(v: str | None) -> str | None:
    return None if v is None or v.strip().lower() in ("", "off", "none", "0") else v


def register(sub) -> None:
    p = sub.add_parser(
        "collector",
        help="receive OTLP traces, derive per-request metrics, export to Prometheus/OTLP",
        description="Receive spans from engines (engine_hooks) and clients over OTLP, assemble each "
        "request's trace, derive TTFT/ITL/TPOT/E2E at both boundaries and the client TTFT "
        "decomposition, store one record per request and boundary, and export metrics.",
        epilog="Every option can also be set as OTEL_LLM_COLLECTOR_<OPTION> (e.g. OTEL_LLM_COLLECTOR_STORE). "
        "Addresses take 'off' to disable. Receivers bind to loopback by default.",
    )
    d = CollectorConfig()
    a = AssemblyConfig()
    p.add_argument(
        "--otlp-grpc",
        default=env_default("otlp_grpc", d.otlp_grpc),
        metavar="HOST:PORT",
        help=f"OTLP/gRPC receiver (default {d.otlp_grpc})",
    )
    p.add_argument(
        "--otlp-http",
        default=env_default("otlp_http", d.otlp_http),
        metavar="HOST:PORT",
        help=f"OTLP/HTTP receiver, /v1/traces, protobuf or JSON, gzip (default {d.otlp_http})",
    )
    p.add_argument(
        "--prometheus",
        default=env_default("prometheus", d.prometheus),
        metavar="HOST:PORT",
        help=f"Prometheus /metrics endpoint (default {d.prometheus})",
    )
    p.add_argument(
        "--forward-metrics",
        default=env_default("forward_metrics", None),
        metavar="URL",
        help="push metrics over OTLP: http://HOST:4318 or grpc://HOST:4317",
    )
    p.add_argument(
        "--metrics-interval",
        type=float,
        default=float(env_default("metrics_interval", 10.0)),
        metavar="S",
        help="seconds between OTLP metric pushes (default 10)",
    )
    p.add_argument(
        "--forward-traces",
        default=env_default("forward_traces", None),
        metavar="URL",
        help="send every received span on, unchanged, e.g. to Jaeger: http://HOST:4318 or grpc://HOST:4317",
    )
    p.add_argument(
        "--store",
        default=env_default("store", d.store),
        metavar="PATH",
        help=f"per-request SQLite store, appended across restarts (default {d.store}; 'off' to disable)",
    )
    p.add_argument(
        "--trace-grace",
        type=float,
        default=float(env_default("trace_grace", a.grace_s)),
        metavar="S",
        help=f"wait after a trace's last request span before deriving it (default {a.grace_s} s)",
    )
    p.add_argument(
        "--peer-wait",
        type=float,
        default=float(env_default("peer_wait", a.peer_wait_s)),
        metavar="S",
        help="an engine span whose caller sent a traceparent waits this long for the client's span "
        f"(default {a.peer_wait_s} s)",
    )
    p.add_argument(
        "--trace-timeout",
        type=float,
        default=float(env_default("trace_timeout", a.timeout_s)),
        metavar="S",
        help=f"derive a trace at the latest this long after its first span (default {a.timeout_s} s)",
    )
    p.add_argument(
        "--max-traces",
        type=int,
        default=int(env_default("max_traces", a.max_traces)),
        metavar="N",
        help=f"traces held in flight; the oldest is derived early beyond this (default {a.max_traces})",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=int(env_default("max_message_bytes", d.max_message_bytes)),
        metavar="N",
        help=f"largest accepted export request, decompressed (default {d.max_message_bytes})",
    )
    p.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="[NAME:]BOUNDS",
        help="an SLO whose good requests are counted (llm_slo_good_requests_total{slo=NAME}); "
        "bounds in seconds, e.g. ttft=1,tpot=0.05,itl_max=0.5,e2e=10; repeatable",
    )
    p.add_argument(
        "--tpot-undefined",
        choices=("pass", "fail"),
        default="pass",
        help="whether requests with <= 1 output token pass a tpot bound (default pass)",
    )
    p.add_argument(
        "--auth-token",
        default=env_default("auth_token", None),
        metavar="TOKEN",
        help="require 'Authorization: Bearer TOKEN' on both receivers",
    )
    p.add_argument(
        "--tls-cert", default=env_default("tls_cert", None), metavar="PEM", help="TLS certificate for both receivers"
    )
    p.add_argument("--tls-key", default=env_default("tls_key", None), metavar="PEM", help="TLS private key")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> CollectorConfig:
    from otel_llm.cli import CLIError

    env_slo = env_default("slo", None)
    try:
        slos = parse_slos(args.slo or ([env_slo] if env_slo else []), args.tpot_undefined)
    except ValueError as exc:
        raise CLIError(f"--slo: {exc}") from None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise CLIError("--tls-cert and --tls-key go together")
    for name in ("trace_grace", "trace_timeout", "peer_wait"):
        if getattr(args, name) < 0:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 0")
    if args.max_traces < 1 or args.max_message_bytes < 1024:
        raise CLIError("--max-traces must be >= 1 and --max-message-bytes >= 1024")
    return CollectorConfig(
        otlp_grpc=_off(args.otlp_grpc),
        otlp_http=_off(args.otlp_http),
        prometheus=_off(args.prometheus),
        forward_traces=_off(args.forward_traces),
        forward_metrics=_off(args.forward_metrics),
        metrics_interval_s=args.metrics_interval,
        store=_off(args.store),
        assembly=AssemblyConfig(
            grace_s=args.trace_grace,
            peer_wait_s=args.peer_wait,
            timeout_s=args.trace_timeout,
            max_traces=args.max_traces,
        ),
        slos=slos,
        max_message_bytes=args.max_message_bytes,
        auth_token=args.auth_token,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )


def run(args: argparse.Namespace) -> int:
    from otel_llm.cli import CLIError

    from .service import Collector

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = config_from_args(args)
    try:
        collector = Collector(cfg).start()
    except (OSError, ValueError) as exc:
        raise CLIError(f"collector: {exc}") from None
    done = threading.Event()

    def on_signal(signum, frame):
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    parts = [f"{type(r).__name__.replace('Receiver', '')} {r.address[0]}:{r.address[1]}" for r in collector.receivers]
    if collector.prometheus:
        parts.append(f"Prometheus http://{collector.prometheus.address[0]}:{collector.prometheus.address[1]}/metrics")
    print(
        "otel-llm collector: "
        + ", ".join(parts)
        + (f"; store {cfg.store}" if cfg.store else "")
        + (f"; SLOs {', '.join(f'{k}={v.describe()}' for k, v in cfg.slos.items())}" if cfg.slos else ""),
        flush=True,
    )
    done.wait()
    print("otel-llm collector: stopping, flushing traces in flight to the store...", file=sys.stderr, flush=True)
    collector.stop()
    c = collector.self_counters()
    print(
        f"otel-llm collector: stopped; {c['records_derived']} records derived, {c.get('store_records', 0)} stored",
        file=sys.stderr,
        flush=True,
    )
    return 0


def register_compare(sub) -> None:
    p = sub.add_parser(
        "compare",
        help="client vs engine per request: where the client's TTFT went",
        description="From the collector's store: per request and as distributions, client TTFT = network_in + "
        "queue + prefill + delivery; client vs engine ITL; stalls the engine did not have (delivery) "
        "and those it did (preemption, other). Bounds the clock offset between client and engine hosts "
        "from the nesting of their spans and corrects network_in and delivery by it.",
    )
    p.add_argument("--store", required=True, metavar="PATH", help="the collector's store")
    p.add_argument(
        "--clock-offset",
        default="auto",
        metavar="auto|SECONDS",
        help="engine clock minus client clock: 'auto' estimates it from span nesting (0 when the bounds "
        "allow one clock); a number applies it",
    )
    p.add_argument(
        "--stall",
        type=float,
        default=0.1,
        metavar="S",
        help="a client inter-token gap above this is a stall (default 0.1 s)",
    )
    p.add_argument("--percentiles", default="50,90,99", help="percentiles of the distributions (default 50,90,99)")
    p.add_argument("--percentile-method", choices=("nearest-rank", "linear"), default="nearest-rank")
    p.add_argument("--top", type=int, default=20, help="table/markdown: requests listed, slowest client TTFT first")
    p.add_argument("--format", choices=("table", "json", "markdown"), default="table")
    p.set_defaults(func=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    import json

    from otel_llm.cli import CLIError

    from .compare import compare, summarize_comparison, to_json
    from .report import format_comparison
    from .store import open_existing

    try:
        offset = None if args.clock_offset == "auto" else float(args.clock_offset)
    except ValueError:
        raise CLIError("--clock-offset: 'auto' or a number of seconds") from None
    ps = [p.strip() for p in args.percentiles.split(",") if p.strip()]
    try:
        store = open_existing(args.store)
    except (OSError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    try:
        records = store.records()
    finally:
        store.close()
    cmp = compare(records, offset, args.stall)
    if not cmp.rows:
        raise CLIError(f"{args.store}: no request seen at both boundaries ({len(records)} records)")
    summary = summarize_comparison(cmp, ps, args.percentile_method)
    if args.format == "json":
        print(json.dumps(to_json(cmp, summary), indent=2))
    else:
        sys.stdout.write(format_comparison(cmp.rows, summary, args.top, markdown=args.format == "markdown"))
    return 0
