"""The store writer: appends derived record batches to the SQLite store from a process of its own.

A row costs SQLite ~10 us of CPU (two rows a request), as much as decoding, assembling and
deriving the request together. In a child process it runs on another core under its own GIL
(in a thread it could not: the rows are bound to the statement holding the GIL, so the two
threads take turns). The child is ``python -m collector.store_writer PATH``; batches go to it
pickled over its stdin, one acknowledgement per batch comes back over its stdout. It ignores
SIGINT/SIGTERM and lives exactly as long as its stdin is open: closing it (:meth:`close`) makes
it store what it was sent and exit; if the collector dies, the child sees end of file and exits.

:meth:`put` blocks while ``max_pending`` batches are unacknowledged (backpressure: the
derivation backlog grows and the receivers answer UNAVAILABLE). If the child cannot be started
or dies, the writer logs it, counts the batches lost with it, and writes in-process from then on.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading

from .records import RecordBatch
from .store import RequestStore

log = logging.getLogger("collector")


class StoreWriter:
    """Writes to ``store``'s file from the child process, or through ``store`` itself in-process
    (``in_process=True``, or once the child is gone). The caller owns ``store`` and closes it."""

    def __init__(self, store: RequestStore, max_pending: int = 16, in_process: bool = False):
        self.store = store
        self.stored = 0
        self.duplicates = 0
        self.failed_batches = 0
        self._slots = threading.Semaphore(max_pending)
        self._max_pending = max_pending
        self._send_lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._pending = 0
        self._idle = threading.Condition()
        self._ready = threading.Event()  # the child has its store open
        if not in_process:
            try:
                # one BLAS thread: the writer does no linear algebra, and numpy's OpenBLAS pool
                # busy-waits for a while after start-up, taking a core from the collector
                env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
                # the child imports this very package, wherever it was imported from
                root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "collector.store_writer", store.path],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=env,
                )
                self._acks = threading.Thread(target=self._read_acks, name="collector-store-acks", daemon=True)
                self._acks.start()
            except OSError as exc:
                log.warning("collector: could not start the store writer (%s); writing in-process", exc)
                self._proc = None
        if self._proc is None:
            self._ready.set()

    @property
    def in_process(self) -> bool:
        return self._proc is None

    @property
    def pid(self) -> int | None:
        """The writer process's id (None when writing in-process)."""
        proc = self._proc
        return None if proc is None else proc.pid

    def put(self, batch: RecordBatch) -> None:
        """Hand a batch over to be stored (returns once it is sent, or stored if in-process)."""
        if not len(batch):
            return
        proc = self._proc
        if proc is not None:
            frame = _frame(batch)
            self._slots.acquire()
            with self._idle:
                self._pending += 1
            try:
                with self._send_lock:
                    for part in frame:
                        proc.stdin.write(part)
                    proc.stdin.flush()
                return
            except (OSError, ValueError):  # the child is gone: this batch is written here
                with self._idle:
                    self._pending -= 1
                self._slots.release()
                self._writer_died()
        self._write_local(batch)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the writer process has started and opened the store."""
        return self._ready.wait(timeout)

    def drain(self) -> None:
        """Wait until every batch put so far is stored."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def close(self) -> None:
        """Store everything sent, then stop the child."""
        proc = self._proc
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            self._acks.join()
            proc.wait()

    # -- internals ---------------------------------------------------------------------------
    def _write_local(self, batch: RecordBatch) -> None:
        try:
            n = self.store.add(batch)
        except Exception:
            self.failed_batches += 1
            log.exception("collector: writing %d records to the store failed", len(batch))
            return
        self.stored += n
        self.duplicates += len(batch) - n

    def _writer_died(self) -> None:
        with self._idle:
            if self._proc is None:
                return
            log.error(
                "collector: the store writer process died; %d batches were lost with it; writing "
                "in-process from now on",
                self._pending,
            )
            self.failed_batches += self._pending
            self._pending = 0
            self._proc = None
            self._idle.notify_all()
        for _ in range(self._max_pending):
            self._slots.release()

    def _read_acks(self) -> None:
        out = self._proc.stdout
        while True:
            try:
                ack = pickle.load(out)
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            if ack == "ready":
                self._ready.set()
                continue
            stored, duplicates, failed = ack
            self.stored += stored
            self.duplicates += duplicates
            self.failed_batches += failed
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
            self._slots.release()
        self._ready.set()
        if self._proc is not None and self._pending:
            self._writer_died()


def _frame(batch: RecordBatch) -> list:
    """A batch as the parts of one message: a header of lengths, the pickle, then the numpy
    columns' memory as it is (pickle protocol 5 out-of-band buffers: no copy into the pickle)."""
    buffers: list = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    lengths = [len(data)] + [v.nbytes for v in views]
    head = len(lengths).to_bytes(8, "little") + b"".join(n.to_bytes(8, "little") for n in lengths)
    return [head, data, *views]


def _read_frame(inp) -> RecordBatch | None:
    head = inp.read(8)
    if len(head) < 8:
        return None
    k = int.from_bytes(head, "little")
    raw = inp.read(8 * k)
    lengths = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, 8 * k, 8)]
    data = inp.read(lengths[0])
    buffers = []
    for n in lengths[1:]:
        b = bytearray(n)  # writable, read into in place: the numpy columns own it
        if inp.readinto(b) != n:
            return None
        buffers.append(b)
    return pickle.loads(data, buffers=buffers)


def _child(path: str) -> int:
    """The writer process: length-prefixed pickled batches on stdin, one ack each on stdout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(format="otel-llm store writer: %(message)s")
    store = RequestStore(path, background_checkpoints=True)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    pickle.dump("ready", out)
    out.flush()
    while True:
        batch = _read_frame(inp)
        if batch is None:
            break
        try:
            n = store.add(batch)
            ack = (n, len(batch) - n, 0)
        except Exception:
            log.exception("writing %d records to the store failed", len(batch))
            ack = (0, 0, 1)
        pickle.dump(ack, out)
        out.flush()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
