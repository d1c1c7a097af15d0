"""The durable mode's write-ahead spool (``--spool DIR``): every accepted export request is appended
here before it is answered, and replayed at the next start, so a crash (SIGKILL, the OOM killer)
loses nothing the collector acknowledged.

The spool is a directory of segment files ``NNNNNNNNNNNN.spool``, each a sequence of records
``length (4 bytes LE) | CRC-32 of the body (4 bytes LE) | body`` (the request as protobuf bytes).
Appends go to the newest segment with one ``write`` each (to the kernel: a process crash cannot
lose them; ``fsync=True`` also survives a power loss, at a cost); it is closed and a new one
begun (before the next append) once it holds ``segment_bytes``. A closed segment is deleted once
every trace with a span from it has been derived and stored: the caller tells :meth:`collect` the
arrival time of the oldest trace still in flight and whether the store has written everything
handed to it. A segment found at start counts as closed only once :meth:`replay` has handed out
its last record: its traces are in assembly by then, so a crash loop (crash, restart, crash
again before they are stored) never deletes what was not stored. A torn record at the end of a
segment (the crash came mid-write) is skipped at replay, and counted.

An append that the collector then cannot take (trace assembly full, ``--when-full refuse``) is
undone (:meth:`undo`): what is refused is never replayed.

Replaying may derive a trace whose records were stored before the crash: the store ignores
records it has (keyed by trace, span and boundary), so replay is idempotent.
"""

from __future__ import annotations

import logging
import math
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger("collector")

_HEAD = struct.Struct("<II")
_NAME = re.compile(r"^(\d{12})\.spool$")


class SpoolFull(Exception):
    """The spool holds ``max_bytes`` already (the store is behind): refuse with UNAVAILABLE."""


@dataclass
class _Segment:
    seq: int
    path: str
    size: int = 0
    closed_at: float | None = None  # monotonic seconds; None: the segment being appended to; inf: not replayed yet
    opened_at: float = 0.0


_NOT_REPLAYED = math.inf


class Spool:
    def __init__(
        self,
        directory: str,
        segment_bytes: int = 16 << 20,
        max_bytes: int = 1 << 30,
        fsync: bool = False,
        seal_after_s: float = 30.0,
    ):
        self.directory, self.segment_bytes, self.max_bytes, self.fsync = directory, segment_bytes, max_bytes, fsync
        self.seal_after_s = seal_after_s  # a segment is closed this long after it was begun, if not empty
        os.makedirs(directory, exist_ok=True)
        self.lock = threading.Lock()  # held by the caller across append and assembly (see module doc)
        self.replayed_requests = 0
        self.torn_records = 0
        self.segments_deleted = 0
        self._segments: list[_Segment] = []
        for name in sorted(os.listdir(directory)):
            m = _NAME.match(name)
            if m:
                path = os.path.join(directory, name)
                self._segments.append(_Segment(int(m.group(1)), path, os.path.getsize(path), _NOT_REPLAYED))
        self._bytes = sum(s.size for s in self._segments)
        self._fd: int | None = None
        self._open_new()

    # -- appending (under self.lock) --------------------------------------------------------------
    def _open_new(self) -> None:
        seq = self._segments[-1].seq + 1 if self._segments else 1
        path = os.path.join(self.directory, f"{seq:012d}.spool")
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._segments.append(_Segment(seq, path, opened_at=time.monotonic()))

    def append(self, body: bytes) -> tuple[_Segment, int]:
        """Append one request (caller holds :attr:`lock`). Returns what :meth:`undo` takes. Raises
        SpoolFull or OSError (disk full): the caller refuses the request with UNAVAILABLE."""
        if self._bytes + len(body) + 8 > self.max_bytes:
            raise SpoolFull(f"the spool holds {self._bytes} of {self.max_bytes} bytes")
        cur = self._segments[-1]
        if cur.size >= self.segment_bytes:
            self._close_current()
            cur = self._segments[-1]
        rec = _HEAD.pack(len(body), zlib.crc32(body)) + body
        n = os.write(self._fd, rec)
        if n != len(rec):  # a short write (disk full): undo it, refuse the request
            os.ftruncate(self._fd, cur.size)
            raise OSError(f"short write to the spool ({n} of {len(rec)} bytes)")
        if self.fsync:
            os.fsync(self._fd)
        before = cur.size
        cur.size += n
        self._bytes += n
        return cur, before

    def undo(self, appended: tuple[_Segment, int]) -> None:
        """Take back the last :meth:`append` (caller holds :attr:`lock`, across both): the request
        was refused after all, so it must not be replayed."""
        seg, before = appended
        if seg is not self._segments[-1] or self._fd is None:
            raise RuntimeError("only the last append can be undone")
        os.ftruncate(self._fd, before)
        if self.fsync:
            os.fsync(self._fd)
        self._bytes -= seg.size - before
        seg.size = before

    def _close_current(self) -> None:
        os.close(self._fd)
        self._segments[-1].closed_at = time.monotonic()
        self._open_new()

    # -- replay and clean-up ---------------------------------------------------------------------
    def replay(self) -> Iterator[bytes]:
        """The bodies of every segment found at start, oldest first. Each such segment counts as
        closed (collectable) from the moment its last body has been taken: the caller assembles
        each body before asking for the next."""
        for seg in [s for s in self._segments if s.closed_at == _NOT_REPLAYED]:
            with open(seg.path, "rb") as fh:
                data = fh.read()
            i = 0
            while i + 8 <= len(data):
                n, crc = _HEAD.unpack_from(data, i)
                body = data[i + 8 : i + 8 + n]
                if len(body) < n or zlib.crc32(body) != crc:
                    self.torn_records += 1
                    log.warning(
                        "collector: spool %s: a torn record at byte %d (a crash mid-write); skipped", seg.path, i
                    )
                    break
                self.replayed_requests += 1
                yield body
                i += 8 + n
            else:
                if i != len(data):
                    self.torn_records += 1
            seg.closed_at = time.monotonic()

    def collect(self, oldest_in_flight: float | None, store_idle: bool) -> int:
        """Delete the closed segments whose traces are all derived and stored: closed before the
        oldest trace still in flight arrived (``None``: none in flight), with the store idle.
        Returns the number deleted."""
        cur = self._segments[-1]
        if cur.size and time.monotonic() - cur.opened_at > self.seal_after_s:
            self.seal()
        if not store_idle:
            return 0
        gone = 0
        with self.lock:
            while len(self._segments) > 1:
                seg = self._segments[0]
                if seg.closed_at in (None, _NOT_REPLAYED) or (
                    oldest_in_flight is not None and oldest_in_flight <= seg.closed_at
                ):
                    break
                os.remove(seg.path)
                self._bytes -= seg.size
                self._segments.pop(0)
                gone += 1
        self.segments_deleted += gone
        return gone

    def seal(self) -> None:
        """Close the current segment now (so it can be collected once its traces are stored)."""
        with self.lock:
            cur = self._segments[-1]
            if cur.size:
                self._close_current()

    @property
    def to_replay(self) -> int:
        """Segments found at start whose records have not all been handed out by :meth:`replay`."""
        return sum(1 for s in self._segments if s.closed_at == _NOT_REPLAYED)

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def segments(self) -> int:
        return len(self._segments)

    def close(self) -> None:
        with self.lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            cur = self._segments[-1]
            if cur.size == 0:  # nothing in it: no need to keep an empty file
                os.remove(cur.path)
                self._segments.pop()
