"""The collector's configuration: one dataclass, every option also settable by an
``OTEL_LLM_COLLECTOR_*`` environment variable (the command line wins)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from otel_llm.slo import SLO

from .assembly import AssemblyConfig


@dataclass
class CollectorConfig:
    otlp_grpc: str | None = "127.0.0.1:4317"  # None: off
    otlp_http: str | None = "127.0.0.1:4318"
    prometheus: str | None = "127.0.0.1:9464"
    forward_traces: str | None = None
    forward_metrics: str | None = None
    metrics_interval_s: float = 10.0
    store: str | None = "otel-llm.db"
    assembly: AssemblyConfig = field(default_factory=AssemblyConfig)
    slos: dict[str, SLO] = field(default_factory=dict)
    max_message_bytes: int = 4 * 2**20
    max_backlog: int = 50_000  # released traces waiting for derivation before receivers answer UNAVAILABLE
    auth_token: str | None = None  # bearer token both receivers require, when set
    tls_cert: str | None = None
    tls_key: str | None = None
    tick_s: float = 0.1


ENV_PREFIX = "OTEL_LLM_COLLECTOR_"


def env_default(name: str, default):
    """``OTEL_LLM_COLLECTOR_<NAME>`` if set, else ``default``."""
    return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"), default)


def host_port(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad address {addr!r}: expected HOST:PORT")
    return (host.strip("[]") or "127.0.0.1"), int(port)


def parse_slos(values: list[str], tpot_undefined: str = "pass") -> dict[str, SLO]:
    """``--slo [NAME:]ttft=1,tpot=0.05`` (repeatable); the name defaults to ``default``."""
    out: dict[str, SLO] = {}
    for v in values:
        name, sep, bounds = v.partition(":")
        if not sep:
            name, bounds = "default", v
        name = name.strip()
        if not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"bad SLO name {name!r}")
        if name in out:
            raise ValueError(f"SLO {name!r} given twice")
        out[name] = SLO.parse(bounds, tpot_undefined)
        if not out[name].bounds:
            raise ValueError(f"SLO {name!r} has no bounds")
    return out


__all__ = ["CollectorConfig", "env_default", "host_port", "parse_slos"]
