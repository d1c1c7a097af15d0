"""A harness for the collector as users run it: a real ``otel-llm collector`` process, senders that
speak the wire (raw HTTP/1.1 keep-alive connections, raw gRPC calls, OTLP bodies built by hand),
SIGKILL / SIGTERM at chosen moments, and the store read back, so a test compares what was
acknowledged with what was stored: each acknowledged request stored exactly once.

Bodies: one export request (client and engine spans of one request, encoded by the OpenTelemetry
SDK) is the template; request ``i`` is that template with its trace id and request id replaced
byte for byte, so thousands of distinct requests cost no SDK call each.
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from support.otlp_helpers import Req, free_port, sample_request

ROOT = Path(__file__).resolve().parents[2]
_ID = "R" + "0" * 11  # the template's request id; request i's is R + i in 11 digits


class Bodies:
    """``body(i)``: the export request of request ``R<i>`` (trace id ``i`` and ``salt``)."""

    def __init__(self, salt: int = 0, tokens: int = 3):
        """``tokens``: token events at each boundary (3: a body of about 2 KB; 300: 7.7 KB, a
        request of 300 tokens as an engine sends it)."""
        ms = [i * 0.01 for i in range(tokens)]
        req = sample_request(
            [Req(_ID)]
            if tokens == 3
            else [
                Req(
                    _ID,
                    client_events=[(100 + t, 1) for t in ms],
                    client_end=105 + ms[-1],
                    engine_events=[(85 + t, 1) for t in ms],
                )
            ]
        )
        self._trace_id = req.resource_spans[0].scope_spans[0].spans[0].trace_id
        self.template = req.SerializeToString()
        assert self.template.count(self._trace_id) >= 2 and _ID.encode() in self.template
        self.salt = (salt + 1).to_bytes(8, "big")  # never an all-zero (invalid) trace id

    @staticmethod
    def request_id(i: int) -> str:
        return f"R{i:011d}"

    def body(self, i: int) -> bytes:
        tid = i.to_bytes(8, "big") + self.salt
        return self.template.replace(self._trace_id, tid).replace(_ID.encode(), self.request_id(i).encode())


@dataclass
class Collector:
    """``otel-llm collector`` as a process: HTTP and gRPC receivers on free loopback ports."""

    store: Path
    args: tuple = ()
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> Collector:
        cmd = [sys.executable, "-m", "otel_llm", "collector", "--prometheus", "off"]
        cmd += ["--otlp-http", f"127.0.0.1:{self.http_port}", "--otlp-grpc", f"127.0.0.1:{self.grpc_port}"]
        cmd += ["--store", str(self.store), *self.args]
        self.log = open(self.store.with_suffix(f".{time.monotonic_ns()}.log"), "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True
        )
        line = self.proc.stdout.readline()
        if "otel-llm collector:" not in line:
            self.proc.kill()
            raise RuntimeError(f"collector did not start: {line!r} {self.stderr()}")
        return self

    def stderr(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout_s: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


def http_post(sock: socket.socket, body: bytes, port: int, extra: bytes = b"") -> int:
    """One POST /v1/traces on an open keep-alive connection; returns the status code (raises
    OSError or ConnectionError when the connection is gone)."""
    head = (
        f"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/x-protobuf\r\n"
        f"Content-Length: {len(body)}\r\n"
    ).encode()
    sock.sendall(head + extra + b"\r\n" + body)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the response")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = next((int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:]) if k.lower() == b"content-length"), 0)
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed mid-response")
        rest += chunk
    return status


@dataclass
class Outcome:
    acked: set = field(default_factory=set)  # request numbers answered 200 / OK
    refused: set = field(default_factory=set)  # answered 503 / UNAVAILABLE
    unknown: set = field(default_factory=set)  # sent, no answer (the connection or process died)


class Senders:
    """``n`` threads sending distinct requests to one collector until :meth:`stop`: raw HTTP/1.1
    keep-alive (each thread one connection, reconnecting when it is closed) or raw gRPC calls."""

    def __init__(self, bodies: Bodies, port: int, n: int = 4, proto: str = "http", start_at: int = 0, pace_s=0.0):
        self.bodies, self.port, self.proto, self.pace_s = bodies, port, proto, pace_s
        self.outcome = Outcome()
        self._next = start_at
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _take(self) -> int:
        with self._lock:
            self._next += 1
            return self._next - 1

    def _record(self, what: set, i: int) -> None:
        with self._lock:
            what.add(i)

    def _run(self) -> None:
        o = self.outcome
        while not self._stop.is_set():
            try:
                if self.proto == "http":
                    conn = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                    send = lambda b, c=conn: http_post(c, b, self.port)
                else:
                    import grpc

                    ch = grpc.insecure_channel(f"127.0.0.1:{self.port}")
                    call = ch.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")

                    def send(b, call=call):
                        try:
                            call(b, timeout=10)
                            return 200
                        except grpc.RpcError as exc:
                            # refused is the collector's own answer; UNAVAILABLE is also what gRPC
                            # says of a call whose server died under it (it may have been kept)
                            if exc.code() == grpc.StatusCode.UNAVAILABLE and "collector" in (exc.details() or ""):
                                return 503
                            raise ConnectionError(str(exc.code())) from None
            except OSError:
                time.sleep(0.05)
                continue
            try:
                while not self._stop.is_set():
                    i = self._take()
                    try:
                        code = send(self.bodies.body(i))
                    except (OSError, ConnectionError):
                        self._record(o.unknown, i)
                        break
                    self._record(o.acked if code == 200 else o.refused if code == 503 else o.unknown, i)
                    if self.pace_s:
                        time.sleep(self.pace_s)
            finally:
                if self.proto == "http":
                    conn.close()
                else:
                    ch.close()

    def counts(self) -> tuple[int, int]:
        """(acknowledged, refused) so far."""
        with self._lock:
            return len(self.outcome.acked), len(self.outcome.refused)

    def start(self) -> Senders:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> Outcome:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        return self.outcome


def stored(store: Path) -> dict[tuple[str, str], int]:
    """(request id, boundary) -> rows in the store."""
    if not store.exists():
        return {}
    con = sqlite3.connect(store)
    try:
        rows = con.execute("SELECT request_id, boundary, count(*) FROM requests GROUP BY 1, 2").fetchall()
    except sqlite3.OperationalError:  # no table yet
        return {}
    finally:
        con.close()
    return {(r, b): n for r, b, n in rows}


def missing_or_twice(store: Path, acked: set) -> tuple[list, list]:
    """The acknowledged requests not stored at both boundaries, and any row stored more than once."""
    rows = stored(store)
    ids = {Bodies.request_id(i) for i in acked}
    missing = sorted(r for r in ids if rows.get((r, "client"), 0) < 1 or rows.get((r, "engine"), 0) < 1)
    twice = sorted(k for k, n in rows.items() if n > 1)
    return missing, twice
