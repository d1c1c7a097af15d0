"""An endpoint that accepts every connection, reads nothing and never answers (a hung collector, a
blackholed proxy), and the span processes of a set of traced processes."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

from engine_hooks.span_process.parent import SPAN_PROCESS_ARG


@contextlib.contextmanager
def hung_endpoint() -> Iterator[int]:
    """A loopback port that accepts and never answers, for as long as the block runs; yields the port."""
    server = socket.create_server(("127.0.0.1", 0), backlog=1000)
    held: list = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        for conn in held:
            conn.close()


def processes() -> dict[int, tuple[int, list[bytes]]]:
    """Every process of the machine: pid -> (parent pid, command line)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                args = fh.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        found[int(pid)] = (ppid, args)
    return found


def span_processes(root: int) -> dict[int, list[int]]:
    """The span processes under ``root`` and its descendants: parent pid -> its span processes' pids."""
    procs = processes()
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, (ppid, _) in procs.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    out: dict[int, list[int]] = {}
    for pid, (ppid, args) in procs.items():
        if ppid in tree and SPAN_PROCESS_ARG.encode() in args:
            out.setdefault(ppid, []).append(pid)
    return out
