"""deploy/: the compose files and the OpenTelemetry Collector configs agree with the CLI (every
option a collector is started with exists and parses) and with each other (the router sends to
the shards' OTLP ports, Prometheus scrapes their metrics ports, names resolve to services)."""

from __future__ import annotations

import pytest
import yaml
from conftest import ROOT, run_cli

from collector.cli import config_from_args
from otel_llm.cli import build_parser

DEPLOY = ROOT / "deploy"


def load(path):
    return yaml.safe_load((DEPLOY / path).read_text())


def collectors(compose: dict) -> dict[str, list[str]]:
    return {
        name: svc["command"]
        for name, svc in compose["services"].items()
        if isinstance(svc.get("command"), list) and svc["command"][:1] == ["collector"]
    }


def options(command: list[str]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in command[1:])


@pytest.mark.parametrize("compose", ["docker-compose.yml", "sharded/docker-compose.yml"])
def test_collector_commands_are_real_options(compose):
    help_text = run_cli("collector", "--help").stdout
    cols = collectors(load(compose))
    assert cols
    for name, cmd in cols.items():
        for flag in options(cmd):
            assert flag in help_text, (compose, name, flag)
        cfg = config_from_args(build_parser().parse_args(cmd))  # every value parses as the CLI would
        assert cfg.prometheus and cfg.store, name


def test_the_router_reaches_every_shard():
    compose = load("sharded/docker-compose.yml")
    shards = collectors(compose)
    assert len(shards) == 3
    opts = {name: options(cmd) for name, cmd in shards.items()}
    assert len({o["--store"] for o in opts.values()}) == 3 and len({o["--instance-id"] for o in opts.values()}) == 3
    grpc_port = {name: o["--otlp-grpc"].rsplit(":", 1)[1] for name, o in opts.items()}
    router = load("sharded/otelcol.yml")
    lb = router["exporters"]["loadbalancing"]
    assert lb["routing_key"] == "traceID"
    targets = dict(h.rsplit(":", 1) for h in lb["resolver"]["static"]["hostnames"])
    assert targets == grpc_port  # every shard, at its --otlp-grpc port, and nothing else
    assert "loadbalancing" in router["service"]["pipelines"]["traces"]["exporters"]
    jaeger = router["exporters"]["otlp/jaeger"]["endpoint"].split(":")[0]
    assert jaeger in compose["services"]
    assert "router" in compose["services"] and "4317:4317" in compose["services"]["router"]["ports"]
    dns = load("sharded/otelcol-dns.yml")["exporters"]["loadbalancing"]
    assert dns["routing_key"] == "traceID" and dns["resolver"]["dns"]["port"] == "4317"
    prom = load("sharded/prometheus.yml")
    scraped = set(prom["scrape_configs"][0]["static_configs"][0]["targets"])
    assert scraped == {f"{n}:{o['--prometheus'].rsplit(':', 1)[1]}" for n, o in opts.items()}


def test_the_single_compose_file_is_consistent():
    compose = load("docker-compose.yml")
    (cmd,) = collectors(compose).values()
    o = options(cmd)
    target = load("prometheus.yml")["scrape_configs"][0]["static_configs"][0]["targets"][0]
    assert target == "collector:" + o["--prometheus"].rsplit(":", 1)[1]
    assert o["--forward-traces"].startswith("grpc://jaeger:") and "jaeger" in compose["services"]
