"""Prometheus exposition of the derived metrics (text format 0.0.4) on ``--prometheus``.

OpenTelemetry names become Prometheus names as the OpenTelemetry Prometheus exporter does:
dots to underscores, the unit as a suffix (``_seconds``), ``_total`` on counters. The
collector's own counters and levels are exposed too, as ``otel_llm_collector_*`` (declared in
:mod:`collector.health`).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..config import listen
from ..health import help_of, series_name
from ..pipeline.metrics_registry import Counter, Histogram
from ..receivers.intake import token_matches
from ..tls import HandshakeInThread, is_handshake_failure, wrap_listener

UNIT_SUFFIX = {"s": "seconds", "ms": "milliseconds", "By": "bytes"}
_NOT_IN_GRAMMAR = re.compile(r"[^a-zA-Z0-9_:]")


def prom_name(name: str, unit: str, counter: bool = False) -> str:
    """The Prometheus name of an OpenTelemetry metric: every character outside the Prometheus
    grammar ``[a-zA-Z_:][a-zA-Z0-9_:]*`` becomes ``_`` (whatever a sender named its metric, the
    exposition stays parseable), then the unit's suffix and, for counters, ``_total``."""
    base = _NOT_IN_GRAMMAR.sub("_", name)
    if not base or base[0].isdigit():
        base = "_" + base
    suffix = UNIT_SUFFIX.get(unit)
    if suffix and not base.endswith("_" + suffix):
        base += "_" + suffix
    if counter and not base.endswith("_total"):
        base += "_total"
    return base


def family_name(name: str, unit: str, histogram: bool) -> str:
    """The exposed name of a derived family: a histogram's with its unit's suffix, a counter's with
    ``_total`` (its unit is in its OpenTelemetry name where it has one)."""
    return prom_name(name, unit) if histogram else prom_name(name, "", counter=True)


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _help(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace("\n", "\\n")


def _labels(names, values, extra: str = "") -> str:
    parts = [f'{n}="{_esc(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


def render(
    families: list,
    self_counters: dict[str, float] | None = None,
    instance: str | None = None,
    self_levels: dict[str, float] | None = None,
) -> str:
    """The exposition text. ``instance`` labels every series ``collector_instance`` (several
    collectors behind a load balancer: each series says which one; sum them away in PromQL).
    The collector's own health: ``self_counters`` as counters (``_total``), ``self_levels`` (its
    buffers' levels and bounds) as gauges."""
    out: list[str] = []
    inst = f'collector_instance="{_esc(instance)}"' if instance else ""
    join = lambda *xs: ",".join(x for x in xs if x)
    for f in families:
        if isinstance(f, Histogram):
            n = family_name(f.name, f.unit, histogram=True)
            out.append(f"# HELP {n} {_help(f.description)}")
            out.append(f"# TYPE {n} histogram")
            for labels, s in sorted(f.series.items()):
                cum = 0
                for b, c in zip(list(f.bounds) + [math.inf], s.counts.tolist()):
                    cum += c
                    le = "le=" + chr(34) + _num(b) + chr(34)
                    out.append(f"{n}_bucket{_labels(f.label_names, labels, join(inst, le))} {cum}")
                out.append(f"{n}_sum{_labels(f.label_names, labels, inst)} {_num(s.sum)}")
                out.append(f"{n}_count{_labels(f.label_names, labels, inst)} {s.count}")
        elif isinstance(f, Counter):
            n = family_name(f.name, f.unit, histogram=False)
            out.append(f"# HELP {n} {_help(f.description)}")
            out.append(f"# TYPE {n} counter")
            for labels, v in sorted(f.series.items()):
                out.append(f"{n}{_labels(f.label_names, labels, inst)} {_num(v)}")
    own = [(k, v, False) for k, v in (self_counters or {}).items()]
    own += [(k, v, True) for k, v in (self_levels or {}).items()]
    for key, v, gauge in sorted(own):  # the collector's own health
        n = series_name(key, gauge)
        out.append(f"# HELP {n} {_help(help_of(key, gauge))}")
        out.append(f"# TYPE {n} {'gauge' if gauge else 'counter'}")
        out.append(f"{n}{_labels((), (), inst)} {_num(v)}")
    return "\n".join(out) + "\n"


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        import sys

        if not is_handshake_failure(sys.exc_info()[1]):  # a failed TLS handshake is the client's
            super().handle_error(request, client_address)


class PrometheusEndpoint:
    """Serves ``/metrics`` from a snapshot callable; over TLS when given a certificate and key
    (the receivers' own: a token required on ``/metrics`` never travels in cleartext)."""

    def __init__(
        self,
        host: str,
        port: int,
        snapshot: Callable[[], list],
        self_counters: Callable[[], dict],
        self_levels: Callable[[], dict] | None = None,
        token: str | None = None,
        instance: str | None = None,
        tls: tuple[str, str] | None = None,
    ):
        snap, selfc, levels = snapshot, self_counters, self_levels or dict

        class Handler(HandshakeInThread, BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "see /metrics")
                    return
                if token and not token_matches(self.headers.get("Authorization"), token):
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", "Bearer")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = render(snap(), selfc(), instance, levels()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = listen(_Server, host, port, Handler, "Prometheus endpoint")
        if tls is not None:
            wrap_listener(self.server, *tls)
        self.address = self.server.server_address
        self._thread = threading.Thread(target=self.server.serve_forever, name="prometheus", daemon=True)

    def start(self) -> PrometheusEndpoint:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
