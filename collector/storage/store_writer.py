"""The store writer: appends derived record batches to the SQLite store from a process of its own.

A row costs SQLite ~10 us of CPU (two rows a request), as much as decoding, assembling and
deriving the request together. In a child process it runs on another core under its own GIL
(in a thread it could not: the rows are bound to the statement holding the GIL, so the two
threads take turns). The child is ``python -m collector.storage.store_writer PATH``; batches go to it
pickled over its stdin, one acknowledgement per batch comes back over its stdout. It ignores
SIGINT/SIGTERM and lives exactly as long as its stdin is open: closing it (:meth:`close`) makes
it store what it was sent and exit; if the collector dies, the child sees end of file and exits.

:meth:`put` blocks while ``max_pending`` batches are unacknowledged (backpressure: the
derivation backlog grows and the receivers answer UNAVAILABLE). If the child cannot be started
or dies, the writer logs it, counts the batches lost with it, and writes in-process from then on.

A batch the store cannot write (a full disk, an I/O error) is not lost: it is kept in memory, up to
``max_unwritten`` records (beyond, the oldest are dropped and counted as ``records_lost``), and
written again by :meth:`retry` (the collector calls it every tick, at most every ``retry_s``).
While anything is unwritten, :attr:`error` says why and the collector refuses new data with
UNAVAILABLE / 503 until the store takes writes again.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import deque

from ..pipeline.records import RecordBatch
from ..pipeline.steps import StepBatch
from .store import RequestStore

log = logging.getLogger("collector")


class StoreWriter:
    """Writes to ``store``'s file from the child process, or through ``store`` itself in-process
    (``in_process=True``, or once the child is gone). The caller owns ``store`` and closes it."""

    def __init__(
        self,
        store: RequestStore,
        max_pending: int = 16,
        in_process: bool = False,
        max_unwritten: int = 500_000,
        retry_s: float = 1.0,
    ):
        self.store = store
        self.stored = 0
        self.duplicates = 0
        self.steps_stored = 0  # engine steps (collector.pipeline.steps), apart from the request records
        self.failed_batches = 0  # batches a write failed for (kept and written again)
        self.records_lost = 0  # records dropped: over max_unwritten, or lost with the writer process
        self.error: str | None = None  # why the last write failed, while anything is unwritten
        self.max_unwritten, self.retry_s = max_unwritten, retry_s
        self._sent: deque[RecordBatch] = deque()  # sent to the child, not acknowledged yet (in order)
        self._unwritten: deque[RecordBatch] = deque()
        self._unwritten_records = 0
        self._last_retry = 0.0
        self._kept_lock = threading.Lock()
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
                    [sys.executable, "-m", "collector.storage.store_writer", store.path],
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

    def put(self, batch: RecordBatch | StepBatch) -> None:
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
                    self._sent.append(batch)
                    for part in frame:
                        proc.stdin.write(part)
                    proc.stdin.flush()
                return
            except (OSError, ValueError):  # the child is gone: this batch is written here
                with self._idle:
                    self._pending -= 1
                    if self._sent and self._sent[-1] is batch:
                        self._sent.pop()
                self._slots.release()
                self._writer_died()
        self._write_local(batch)

    @property
    def idle(self) -> bool:
        """Everything handed over so far is in the store."""
        return self._pending == 0 and not self._unwritten and not self._sent

    @property
    def unwritten_records(self) -> int:
        """Records kept in memory because the store could not take them."""
        return self._unwritten_records

    def retry(self, force: bool = False) -> None:
        """Write the kept batches again (at most every ``retry_s`` unless ``force``)."""
        now = time.monotonic()
        if not self._unwritten or (not force and now - self._last_retry < self.retry_s):
            return
        self._last_retry = now
        with self._kept_lock:
            again = list(self._unwritten)
            self._unwritten.clear()
            self._unwritten_records = 0
        for b in again:
            self.put(b)

    def _keep(self, batch: RecordBatch, why: str) -> None:
        """A batch the store refused: kept to be written again."""
        with self._kept_lock:
            self.failed_batches += 1
            self.error = why
            self._unwritten.append(batch)
            self._unwritten_records += len(batch)
            while self._unwritten_records > self.max_unwritten and len(self._unwritten) > 1:
                old = self._unwritten.popleft()
                self._unwritten_records -= len(old)
                self.records_lost += len(old)
                log.error("collector: %d records dropped: the store has not taken writes for a while", len(old))

    def _wrote(self) -> None:
        if self.error is not None and not self._unwritten:
            with self._kept_lock:
                if not self._unwritten:
                    self.error = None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the writer process has started and opened the store."""
        return self._ready.wait(timeout)

    def drain(self) -> None:
        """Wait until every batch put so far is stored."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def close(self, timeout_s: float = 5.0) -> None:
        """Store everything sent (and, for up to ``timeout_s``, what the store refused), then stop
        the child. What still cannot be written is logged and counted as lost."""
        deadline = time.monotonic() + timeout_s
        while self._unwritten and time.monotonic() < deadline:
            self.retry(force=True)
            self.drain()
            if self._unwritten:
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        if self._unwritten:
            log.error(
                "collector: %d records could not be written to the store (%s) and are lost",
                self._unwritten_records,
                self.error,
            )
            self.records_lost += self._unwritten_records
            self._unwritten.clear()
            self._unwritten_records = 0
        proc = self._proc
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            self._acks.join(max(1.0, deadline - time.monotonic()))
            if self._acks.is_alive():  # the child is still writing: the time is up
                proc.kill()
                self._acks.join()
                log.error("collector: the store writer was stopped at the shutdown timeout")
            proc.wait()
            left = sum(len(b) for b in self._sent) + self._unwritten_records
            if left:  # unacknowledged when the writer was stopped
                self.records_lost += left
                log.error("collector: %d records were not written to the store and are lost", left)
            self._sent.clear()
            self._unwritten.clear()
            self._unwritten_records = 0

    # -- internals ---------------------------------------------------------------------------
    def _write_local(self, batch: RecordBatch) -> None:
        try:
            n = self.store.add(batch)
        except Exception as exc:
            if self.error is None:
                log.error("collector: writing %d records to the store failed (%s); kept, retrying", len(batch), exc)
            self._keep(batch, f"{type(exc).__name__}: {exc}")
            return
        self._count(batch, n, len(batch) - n)
        self._wrote()

    def _count(self, batch, stored: int, duplicates: int) -> None:
        if isinstance(batch, StepBatch):
            self.steps_stored += stored
        else:
            self.stored += stored
            self.duplicates += duplicates

    def _writer_died(self) -> None:
        with self._idle:
            if self._proc is None:
                return
            lost = list(self._sent)  # sent, never acknowledged: written again here
            self._sent.clear()
            log.error(
                "collector: the store writer process died; %d unacknowledged batches are written "
                "in-process, as everything from now on",
                len(lost),
            )
            self._pending = 0
            self._proc = None
            for b in lost:
                self._keep(b, "the store writer process died")
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
            stored, duplicates, why = ack
            with self._idle:
                batch = self._sent.popleft() if self._sent else None
            if why is None:
                self._count(batch, stored, duplicates)
                self._wrote()
            elif batch is not None:
                if self.error is None:
                    log.error("collector: the store refused %d records (%s); kept, retrying", len(batch), why)
                self._keep(batch, why)
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
            ack = (n, len(batch) - n, None)
        except Exception as exc:  # the parent keeps the batch and sends it again
            ack = (0, 0, f"{type(exc).__name__}: {exc}")
        pickle.dump(ack, out)
        out.flush()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
