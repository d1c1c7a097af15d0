"""Slow HTTP senders against a real collector process (#47, item 6): 64 connections from one
address trickling a request's head at about 13 bytes a second, more opened as the collector closes
them. Before, each held a thread and one of --max-connections (64) slots until its deadline: of 60
legitimate exports from another address, 0 were answered 200 here (all 503; #47 saw 4 of 60). Now the
connections are read on an event loop and one peer address holds at most
--max-connections-per-peer of them: every legitimate export (another address) is answered 200,
its p99 within a few times its p99 before the attack."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from support.collector_harness import Bodies, Collector, missing_or_twice

pytestmark = pytest.mark.slow

ATTACKER, SENDER = "127.0.0.1", "127.0.0.2"  # two peer addresses on loopback


def _trickler(port: int, stop: threading.Event, opened: list) -> None:
    """Open a connection from ATTACKER, send a request head a byte every 75 ms; again when closed."""
    head = b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\nContent-Length: 999\r\n"
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(ATTACKER, 0)) as s:
                opened.append(1)
                for i in range(10**6):
                    if stop.is_set():
                        return
                    s.sendall(head[i % len(head) : i % len(head) + 1])
                    time.sleep(0.075)
        except OSError:
            time.sleep(0.05)


def _export(port: int, body: bytes) -> tuple[int | str, float]:
    """One OTLP/HTTP export on a new connection from SENDER: (status or the error's name, seconds)."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=20, source_address=(SENDER, 0)) as s:
            s.sendall(
                b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            answer = b""
            while b"\r\n" not in answer:
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
        status: int | str = int(answer.split(b" ")[1]) if answer else "closed"
    except OSError as exc:
        status = type(exc).__name__
    return status, time.perf_counter() - t0


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def test_slow_senders_on_one_address_deny_no_other_sender(tmp_path):
    store = tmp_path / "s.db"
    c = Collector(store, ("--trace-grace", "0.2")).start()
    bodies = Bodies(salt=11)
    stop = threading.Event()
    try:
        before = [_export(c.http_port, bodies.body(i)) for i in range(40)]
        assert {s for s, _ in before} == {200}, before
        opened: list = []
        attackers = [
            threading.Thread(target=_trickler, args=(c.http_port, stop, opened), daemon=True) for _ in range(96)
        ]
        for t in attackers:
            t.start()
        time.sleep(3)  # every slot one address may hold is taken, and more knock
        during = []
        for i in range(60):
            during.append(_export(c.http_port, bodies.body(1000 + i)))
            time.sleep(0.1)
        stop.set()
    finally:
        stop.set()
        assert c.terminate() == 0, c.stderr()
    statuses = [s for s, _ in during]
    print(
        f"{len(opened)} attacking connections; exports during the attack: {statuses.count(200)} of 60 answered 200; "
        f"p99 before {_p99([t for _, t in before]) * 1e3:.1f} ms, during {_p99([t for _, t in during]) * 1e3:.1f} ms"
    )
    assert statuses == [200] * 60, statuses
    assert len(opened) >= 64
    assert _p99([t for _, t in during]) < max(5 * _p99([t for _, t in before]), 0.25)
    missing, twice = missing_or_twice(store, {*range(40), *range(1000, 1060)})
    assert (missing, twice) == ([], [])
