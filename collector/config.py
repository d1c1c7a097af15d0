"""The collector's configuration: dataclasses whose fields declare their command-line options.

Each field made with :func:`option` is an ``otel-llm collector`` option and an
``OTEL_LLM_COLLECTOR_<OPTION>`` environment variable (the command line wins); :mod:`collector.cli`
builds the parser from these fields, so no option exists without its variable. The dataclasses
validate themselves (``ValueError``): built from code, from the environment or from the command
line, a configuration that exists is a usable one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from otel_llm.declared_options import check_minimums as _check_minimums
from otel_llm.declared_options import one_of, options_of, yes_no
from otel_llm.declared_options import option as declared_option
from otel_llm.metrics.fluidity import FluidityTarget
from otel_llm.metrics.slo import SLO

OFF = ("", "off", "none", "0")

#: the rules of --forward-traces-policy
RULES = ("error", "slo", "stall", "ratio", "all")


@dataclass(frozen=True)
class TracePolicy:
    error: bool = False
    slo: bool = False
    stall: bool = False
    ratio: float = 0.0
    all: bool = False

    @classmethod
    def parse(cls, text: str) -> TracePolicy:
        """``error,slo,stall,ratio=0.05`` (any subset; ``all`` alone)."""
        kw: dict = {}
        for part in filter(None, (p.strip().lower() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if name not in RULES or (name == "ratio") != bool(sep):
                raise ValueError(f"bad rule {part!r}: expected error, slo, stall, ratio=F or all")
            if name == "ratio":
                try:
                    kw["ratio"] = float(value)
                except ValueError:
                    raise ValueError(f"ratio={value!r} is not a number") from None
                if not 0 <= kw["ratio"] <= 1:
                    raise ValueError("ratio=F needs 0 <= F <= 1")
            else:
                kw[name] = True
        if not kw:
            raise ValueError("an empty policy: give error, slo, stall, ratio=F or all")
        return cls(**kw)

    def by_ratio(self, trace_id: bytes) -> bool:
        """The deterministic share: the trace id's low 64 bits below ratio x 2^64."""
        return int.from_bytes(trace_id[-8:], "big") < round(self.ratio * 2**64)

    def describe(self) -> str:
        rules = [r for r in ("error", "slo", "stall", "all") if getattr(self, r)]
        return ",".join(rules + ([f"ratio={self.ratio:g}"] if self.ratio else []))


def host_port(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:4317`` too) -> (host, port); an empty host is loopback."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"bad address {addr!r}: expected HOST:PORT with a port from 0 to 65535")
    return (host.strip("[]") or "127.0.0.1"), int(port)


def listen(server_cls, host: str, port: int, handler, what: str):
    """``server_cls((host, port), handler)``; an address that cannot be bound is an OSError that
    names the listener and the address (not only "Address already in use")."""
    try:
        return server_cls((host, port), handler)
    except OSError as exc:
        raise OSError(exc.errno, f"{what} cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def address(text: str) -> str | None:
    """An address option: ``HOST:PORT``, or ``off``."""
    if text.strip().lower() in OFF:
        return None
    host_port(text)
    return text.strip()


def text_or_off(text: str) -> str | None:
    """A URL or path option, or ``off``."""
    return None if text.strip().lower() in OFF else text


def policy_or_off(text: str) -> TracePolicy | None:
    """The ``--forward-traces-policy`` rules, or ``off`` (forward every span as it came)."""
    return None if text.strip().lower() in OFF else TracePolicy.parse(text)


def fluidity_or_off(text: str) -> FluidityTarget | None:
    """The ``--fluidity`` deadlines (``ttft=S,tbt=S[,target=F]``), or ``off``."""
    return None if text.strip().lower() in OFF else FluidityTarget.parse(text)


def option(default: Any, flag: str, metavar: str, help: str, parse: Callable[[str], Any] = str, minimum=None):
    """A configuration field that is also a command-line option (``flag``) and an environment
    variable (:func:`otel_llm.declared_options.option`; a default of None reads ``off``).
    ``parse`` turns the option's text into the field's value (ValueError: bad text); ``minimum``
    bounds a number."""
    return declared_option(default, flag, metavar, help, parse, minimum, unset="off")


@dataclass
class AssemblyConfig:
    """Trace assembly (:mod:`collector.pipeline.assembly`). Seconds are monotonic-clock seconds."""

    grace_s: float = option(
        1.0, "--trace-grace", "S", "wait after a trace's last request span before deriving it", float, 0.0
    )
    peer_wait_s: float = option(
        10.0,
        "--peer-wait",
        "S",
        "an engine span whose caller sent a traceparent waits this long for the client's span, and a client "
        "span that says cancelled for its engine's (an engine sends an aborted request's span after its abort "
        "grace, 1 s)",
        float,
        0.0,
    )
    timeout_s: float = option(
        30.0, "--trace-timeout", "S", "derive a trace at the latest this long after its first span", float, 0.0
    )
    max_traces: int = option(
        100_000, "--max-traces", "N", "traces held in flight; the oldest is derived early beyond this", int, 1
    )
    on_full: str = option(
        "evict",
        "--when-full",
        "evict|refuse",
        "with --max-traces in flight: derive the oldest early (evict), or refuse new traces with "
        "UNAVAILABLE / 503 so senders retry (refuse: backpressure, nothing derived early)",
        one_of("evict", "refuse"),
    )
    max_spans_per_trace: int = option(
        10_000,
        "--max-spans-per-trace",
        "N",
        "spans kept of one trace; later ones are dropped and counted (one trace cannot take the memory)",
        int,
        1,
    )
    remember_released: int = option(
        1_000_000,
        "--remember-traces",
        "N",
        "requests remembered after derivation (about 180 bytes each), so that a sender's late retry of a "
        "request is dropped, not counted twice in the metrics: recognised while fewer than N/2 requests were "
        "released since (at the default and 1,000 requests/s: 500 s, beyond the OTLP exporters' retry window)",
        int,
        0,
    )

    def __post_init__(self) -> None:
        _check_minimums(self)


@dataclass
class ReceiverSettings:
    """What each OTLP receiver needs of the configuration, and nothing else."""

    max_message_bytes: int
    max_connections: int = 1024  # OTLP/HTTP connections at once; the next is refused with 503
    read_timeout_s: float = 10.0  # longest wait for the next bytes of a request (headers, body)
    request_timeout_s: float = 30.0  # longest a whole request may take to arrive (OTLP/HTTP)
    auth_token: str | None = None  # bearer token required, when set
    tls_cert: str | None = None
    tls_key: str | None = None
    max_connections_per_peer: int = 64  # OTLP/HTTP connections one peer address may hold


@dataclass
class CollectorConfig:
    otlp_grpc: str | None = option("127.0.0.1:4317", "--otlp-grpc", "HOST:PORT", "OTLP/gRPC receiver", address)
    otlp_http: str | None = option(
        "127.0.0.1:4318", "--otlp-http", "HOST:PORT", "OTLP/HTTP receiver, /v1/traces, protobuf or JSON, gzip", address
    )
    prometheus: str | None = option(
        "127.0.0.1:9464", "--prometheus", "HOST:PORT", "Prometheus /metrics endpoint", address
    )
    forward_traces: str | None = option(
        None,
        "--forward-traces",
        "URL",
        "send every received span on, unchanged, e.g. to Jaeger: http://HOST:4318 or grpc://HOST:4317",
        text_or_off,
    )
    forward_traces_policy: TracePolicy | None = option(  # noqa: RUF009 (TracePolicy is a frozen dataclass)
        None,
        "--forward-traces-policy",
        "RULES",
        "with --forward-traces: forward only the traces a rule keeps, each whole: error (a request not ok), "
        "slo (a completed request missed an --slo bound), stall (a request stalled), ratio=F (a share F of the "
        "rest, by trace id), all; e.g. error,slo,stall,ratio=0.01. Derived metrics use every span either way",
        policy_or_off,
    )
    forward_max_array_bytes: int = option(
        0,
        "--forward-max-array-bytes",
        "N",
        "with --forward-traces: in the forwarded copy, replace a token array longer than N bytes as text by its "
        "summary (count, first, last, max gap); Grafana Tempo cuts attributes over 2048 bytes, so give 2048 "
        "there. 0 (default): forward every array whole. Derivation uses the whole arrays either way",
        int,
        0,
    )
    forward_queue_bytes: int = option(
        64 << 20,
        "--forward-queue-bytes",
        "N",
        "bytes each forwarding buffer holds at most (--forward-traces' queue, its policy's intake and held "
        "traces, --forward-records' queue: four buffers with a policy); beyond, dropped and counted",
        int,
        1,
    )
    forward_records: str | None = option(
        None,
        "--forward-records",
        "URL",
        "send each derived record as an OTLP log record (event otel_llm.request): http://HOST:4318 or "
        "grpc://HOST:4317 (Loki, ClickHouse, Elasticsearch behind the OpenTelemetry Collector)",
        text_or_off,
    )
    forward_metrics: str | None = option(
        None, "--forward-metrics", "URL", "push metrics over OTLP: http://HOST:4318 or grpc://HOST:4317", text_or_off
    )
    metrics_interval_s: float = option(
        10.0, "--metrics-interval", "S", "seconds between OTLP metric pushes", float, 0.1
    )
    store: str | None = option(
        "otel-llm.db", "--store", "PATH", "per-request SQLite store, appended across restarts", text_or_off
    )
    spool: str | None = option(
        None,
        "--spool",
        "DIR",
        "durable mode: append every accepted request to a write-ahead spool in DIR before answering, "
        "replay it at start (a crash loses nothing acknowledged)",
        text_or_off,
    )
    spool_fsync: bool = option(
        False,
        "--spool-fsync",
        "BOOL",
        "fsync the spool after every request (survives a power loss too; slower)",
        yes_no,
    )
    spool_max_bytes: int = option(
        1 << 30, "--spool-max-bytes", "N", "spool size at most; beyond, new data gets UNAVAILABLE / 503", int, 1 << 16
    )
    spool_segment_bytes: int = 16 << 20  # a spool segment is closed (and can be deleted) at this size
    store_buffer_records: int = option(
        500_000,
        "--store-buffer-records",
        "N",
        "records kept in memory while the store cannot write (disk full); meanwhile new data gets "
        "UNAVAILABLE / 503; beyond this, the oldest are dropped and counted",
        int,
        1,
    )
    assembly: AssemblyConfig = field(default_factory=AssemblyConfig)
    slos: dict[str, SLO] = field(default_factory=dict)
    max_message_bytes: int = option(
        4 * 2**20, "--max-message-bytes", "N", "largest accepted export request, decompressed", int, 1024
    )
    max_connections: int = option(
        1024,
        "--max-connections",
        "N",
        "OTLP/HTTP connections at once (read on an event loop: an idle or slow one costs a buffer, not a thread); "
        "the next is answered 503 and closed",
        int,
        1,
    )
    max_connections_per_peer: int = option(
        64,
        "--max-connections-per-peer",
        "N",
        "OTLP/HTTP connections one peer address may hold at once; its next is answered 503 and closed",
        int,
        1,
    )
    read_timeout_s: float = option(
        10.0, "--read-timeout", "S", "longest wait for the next bytes of an OTLP/HTTP request", float, 0.01
    )
    request_timeout_s: float = option(
        30.0,
        "--request-timeout",
        "S",
        "longest an OTLP/HTTP request may take to arrive, from the connection waiting for it to its last body "
        "byte (a sender trickling bytes cannot hold a connection slot longer)",
        float,
        0.01,
    )
    max_models: int = option(
        100, "--max-label-values", "N", "distinct model labels on the metrics; later ones fold into '_other'", int, 1
    )
    stall_threshold_s: float = option(
        0.1,
        "--stall-threshold",
        "S",
        "a paired request's largest client gap between tokens is a stall (counted by cause) when over both "
        "this and --stall-factor times the median of the request's other gaps",
        float,
        0.0,
    )
    stall_factor: float = option(
        4.0, "--stall-factor", "K", "see --stall-threshold (0: the threshold alone decides)", float, 0.0
    )
    fluidity: FluidityTarget | None = option(  # noqa: RUF009 (FluidityTarget is a frozen dataclass)
        None,
        "--fluidity",
        "DEADLINES",
        "token deadlines ttft=S,tbt=S[,target=F] of the fluidity index (docs/metrics/fluidity.md): each "
        "completed request's index goes to llm_fluidity_index, those at or above the target (default 0.9) "
        "to llm_fluidity_fluid_requests_total (off: not computed)",
        fluidity_or_off,
    )
    max_backlog: int = option(
        50_000,
        "--max-backlog",
        "N",
        "released traces waiting for derivation before the receivers answer UNAVAILABLE / 503",
        int,
        1,
    )
    max_inflight_bytes: int = option(
        512 << 20,
        "--max-inflight-bytes",
        "N",
        "memory the spans in trace assembly and in the derivation backlog may hold, at most (estimated as twice "
        "each request's bytes plus 600 bytes a span: an upper bound); beyond, new data gets UNAVAILABLE / 503",
        int,
        1 << 20,
    )
    max_json_decodes: int = option(
        2,
        "--max-json-decodes",
        "N",
        "OTLP/JSON bodies decoded at once (a 4 MiB body takes ~200 MB while parsed); the next waits "
        "up to a second, then gets UNAVAILABLE / 503",
        int,
        1,
    )
    shutdown_timeout_s: float = option(
        30.0,
        "--shutdown-timeout",
        "S",
        "on SIGTERM / SIGINT, the longest the flush to the store may take; what is left is logged and counted",
        float,
        0.0,
    )
    instance_id: str | None = option(
        None,
        "--instance-id",
        "ID",
        "this collector's id among several: a collector_instance label on every /metrics series (default: "
        "service.instance.id from OTEL_RESOURCE_ATTRIBUTES, else none) and service.instance.id on pushed "
        "metrics and records (default: that, else HOST:PID)",
        text_or_off,
    )
    auth_token: str | None = option(
        None, "--auth-token", "TOKEN", "require 'Authorization: Bearer TOKEN' on both receivers", text_or_off
    )
    metrics_auth: bool = option(
        False,
        "--metrics-auth",
        "BOOL",
        "require the --auth-token on /metrics too (it exposes request counts, latencies and model names)",
        yes_no,
    )
    tls_cert: str | None = option(None, "--tls-cert", "PEM", "TLS certificate for both receivers", text_or_off)
    tls_key: str | None = option(None, "--tls-key", "PEM", "TLS private key", text_or_off)
    tick_s: float = 0.1  # how often the derivation thread releases assembled traces

    def __post_init__(self) -> None:
        _check_minimums(self)
        for name in ("otlp_grpc", "otlp_http", "prometheus"):
            v = getattr(self, name)
            if v is not None:
                host_port(v)
        if self.metrics_auth and not self.auth_token:
            raise ValueError("--metrics-auth needs --auth-token")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tick_s <= 0:
            raise ValueError("tick_s must be > 0")

    @property
    def receiver(self) -> ReceiverSettings:
        return ReceiverSettings(
            self.max_message_bytes,
            self.max_connections,
            self.read_timeout_s,
            self.request_timeout_s,
            self.auth_token,
            self.tls_cert,
            self.tls_key,
            self.max_connections_per_peer,
        )


def parse_slos(values: list[str], tpot_undefined: str = "pass") -> dict[str, SLO]:
    """``--slo [NAME:]ttft=1,tpot=0.05`` (repeatable); the name defaults to ``default``."""
    out: dict[str, SLO] = {}
    for v in values:
        name, slo = SLO.parse_named(v, tpot_undefined)
        if name in out:
            raise ValueError(f"SLO {name!r} given twice")
        out[name] = slo
        if not out[name].bounds:
            raise ValueError(f"SLO {name!r} has no bounds")
    return out


__all__ = [
    "AssemblyConfig",
    "CollectorConfig",
    "ReceiverSettings",
    "address",
    "host_port",
    "option",
    "options_of",
    "parse_slos",
]
