"""The per-request store: one row per request and boundary, in SQLite (WAL), appended to and
kept across restarts. Times are integer Unix ns; token events are int64 offsets from submit
(``event_offsets_ns``) and tokens per event (``event_tokens``, empty when each event carries one
token). ``otel-llm analyze --store`` and ``otel-llm compare`` read it.

No prompt or completion text is stored: only times, counts, ids, model and status.
Rows are unique on (end, trace id, boundary, request id): a request derived again from the same
span is never stored twice. End time first: rows arrive in about end order, so the unique index
grows at its right edge (a random trace id first made every insert a random B-tree descent,
half the cost of a row), and it serves queries over a window of end times.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import urllib.parse
from collections.abc import Sequence
from itertools import chain, pairwise

import numpy as np

from otel_llm.metrics.request_math import segment_sum
from otel_llm.metrics.selection import Selection
from otel_llm.metrics.timeline import TimelineBatch

from ..pipeline.records import COLUMN_NAMES, COLUMNS, RecordBatch, RequestRecord, from_python
from ..pipeline.steps import STEP_COLUMN_DECL, STEP_COLUMNS, STEPS_SCHEMA, StepBatch

log = logging.getLogger("collector")

_WIDTH = len(COLUMN_NAMES) + 2  # columns written per row: the scalars, then the two event blobs
_QUOTED = ", ".join(f'"{c}"' for c in COLUMN_NAMES)

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
  rowid INTEGER PRIMARY KEY,
  {cols},
  event_offsets_ns BLOB NOT NULL,
  event_tokens BLOB NOT NULL,
  UNIQUE (end_ns, trace_id, boundary, request_id)
);
"""


def event_blobs(batch: RecordBatch) -> tuple[list, list]:
    """Each record's token events as stored: offsets as int64 bytes (ns after submit); tokens as
    int64 bytes, or empty when every event carries one token (the common case: half the bytes
    to write). Slices of the batch's arrays, no copies."""
    st = batch.event_start
    ends = (st * 8).tolist()
    offs = memoryview(np.ascontiguousarray(batch.event_offsets_ns, "<i8")).cast("B")
    toks = memoryview(np.ascontiguousarray(batch.event_tokens, "<i8")).cast("B")
    ones = segment_sum((batch.event_tokens != 1).astype(np.int64), st) == 0
    pairs = list(pairwise(ends))
    return ([offs[a:b] for a, b in pairs], [b"" if one else toks[a:b] for (a, b), one in zip(pairs, ones.tolist())])


def decode_events(offsets: list[bytes], tokens: list[bytes]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The inverse of :func:`event_blobs` for many rows at once: (events per row, offsets, tokens)."""
    counts = [len(o) // 8 for o in offsets]
    offs = np.frombuffer(b"".join(offsets), "<i8").astype(np.int64)
    toks = np.ones(len(offs), np.int64)
    at = 0
    for k, blob in zip(counts, tokens):
        if blob:
            toks[at : at + k] = np.frombuffer(blob, "<i8")
        at += k
    return counts, offs, toks


class RequestStore:
    """``background_checkpoints``: copy the write-ahead log into the database from a thread of its
    own (a second connection, every ``checkpoint_interval_s``) instead of inside a commit now and
    then, so the writer does not wait for the copy and its fsyncs (the store writer process)."""

    def __init__(
        self,
        path: str,
        background_checkpoints: bool = False,
        checkpoint_interval_s: float = 0.5,
        readonly: bool = False,
    ):
        self.path = path
        self.readonly = readonly
        d = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(d):  # a typo must not create directories: only the file is made here
            raise FileNotFoundError(f"{path}: the directory {d} does not exist")
        try:
            if readonly:  # readers (analyze, compare, report, export) change nothing in the file
                uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
                self._db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
                tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            else:
                self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
                self._db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"{path}: not an otel-llm store ({exc})") from None
        if readonly:
            if "requests" not in tables:
                self._db.close()
                raise ValueError(f"{path}: not an otel-llm store (no requests table)")
            self._has_steps = "steps" in tables
        else:
            self._db.execute("PRAGMA synchronous=NORMAL")
            cols = ",\n  ".join(f'"{c.name}" {c.kind.sqlite}' for c in COLUMNS)
            self._db.executescript(SCHEMA.format(cols=cols))
            self._db.executescript(STEPS_SCHEMA)
            self._has_steps = True
        # a store written by an earlier version: add the columns it lacks (NULL, unknown, in its
        # rows); read-only, they read as NULL
        have = {row[1] for row in self._db.execute("PRAGMA table_info(requests)")}
        if not readonly:
            for c in COLUMNS:
                if c.name not in have:
                    self._db.execute(f'ALTER TABLE requests ADD COLUMN "{c.name}" {c.kind.sqlite}')
            have = {c.name for c in COLUMNS}
        self._select = ", ".join(f'"{c.name}"' if c.name in have else "NULL" for c in COLUMNS)
        step_have = {row[1] for row in self._db.execute("PRAGMA table_info(steps)")} if self._has_steps else set()
        if not readonly and self._has_steps:
            for c in STEP_COLUMN_DECL:  # columns added since the store was made (waiting, wait_reason)
                if c.name not in step_have:
                    self._db.execute(f"ALTER TABLE steps ADD COLUMN {c.name} {c.kind.sqlite}")
            step_have = set(STEP_COLUMNS)
        self._step_select = ", ".join(c if c in step_have else "NULL" for c in STEP_COLUMNS)
        self._lock = threading.Lock()
        max_vars = self._db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
        self._chunk = max(1, min(256, max_vars // _WIDTH))
        self._insert_chunk = self._insert_rows(self._chunk)
        self.stored = 0
        self.duplicates = 0
        self.steps_stored = 0
        self._checkpointer: threading.Thread | None = None
        self._closing = threading.Event()
        if background_checkpoints:
            self._db.execute("PRAGMA wal_autocheckpoint=0")
            self._checkpointer = threading.Thread(
                target=self._checkpoint_loop, args=(checkpoint_interval_s,), name="store-checkpoint", daemon=True
            )
            self._checkpointer.start()

    def _checkpoint_loop(self, interval: float) -> None:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            while not self._closing.wait(interval):
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as exc:  # busy or I/O: the next round tries again
                    log.debug("store checkpoint: %s", exc)
        finally:
            db.close()

    @staticmethod
    def _insert_rows(n: int) -> str:
        row = "(" + ", ".join("?" * _WIDTH) + ")"
        return f"INSERT OR IGNORE INTO requests ({_QUOTED}, event_offsets_ns, event_tokens) VALUES " + ", ".join(
            [row] * n
        )

    def add(self, batch: RecordBatch | StepBatch) -> int:
        """Append a batch of records, or of engine steps (those already stored are ignored and
        counted)."""
        if not len(batch):
            return 0
        if isinstance(batch, StepBatch):
            return self._add_steps(batch)
        cols = batch.scalar_columns(nan_as_none=False)  # SQLite stores NaN as NULL
        offs, toks = event_blobs(batch)
        # one flat parameter list: rows go in by the statement of many rows (one sqlite3_step,
        # run without the GIL, per chunk), not one step per row
        params = list(chain.from_iterable(zip(*cols.values(), offs, toks)))
        n_rows, width, chunk = len(batch), _WIDTH, self._chunk

        def insert(db):
            full = n_rows - n_rows % chunk
            for a in range(0, full, chunk):
                db.execute(self._insert_chunk, params[a * width : (a + chunk) * width])
            if full < n_rows:
                db.execute(self._insert_rows(n_rows - full), params[full * width :])

        n = self._transaction(insert)
        self.stored += n
        self.duplicates += n_rows - n
        return n

    def _transaction(self, write) -> int:
        """``write(db)`` in one transaction, under the store's lock: the rows it changed (an
        ignored duplicate changes none); rolled back, and its error raised, where it fails."""
        with self._lock:
            before = self._db.total_changes
            self._db.execute("BEGIN")
            try:
                write(self._db)
                self._db.execute("COMMIT")
            except BaseException:
                try:  # SQLite may have rolled back already (a full disk): keep the first error
                    self._db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                raise
            return self._db.total_changes - before

    def _add_steps(self, steps: StepBatch) -> int:
        q = f"INSERT OR IGNORE INTO steps ({', '.join(STEP_COLUMNS)}) VALUES ({', '.join('?' * len(STEP_COLUMNS))})"
        n = self._transaction(lambda db: db.executemany(q, steps.rows()))
        self.steps_stored += n
        return n

    def steps(self, since_ns: int | None = None, until_ns: int | None = None) -> StepBatch:
        """The engine steps stored (overlapping [since_ns, until_ns] when given), by start time."""
        if not self._has_steps:
            return StepBatch.from_rows([])
        q = f"SELECT {self._step_select} FROM steps WHERE end_ns >= ? AND start_ns <= ? ORDER BY start_ns, rowid"
        with self._lock:
            lo, hi = int(since_ns or 0), int(until_ns if until_ns is not None else 2**63 - 1)
            rows = self._db.execute(q, (lo, hi)).fetchall()
        return StepBatch.from_rows(rows)

    def batch(self, boundary: str | None = None) -> RecordBatch:
        """Every stored record (at one boundary), in submit order, as a batch."""
        q = f"SELECT {self._select}, event_offsets_ns, event_tokens FROM requests"
        args: tuple = ()
        if boundary:
            q += " WHERE boundary = ?"
            args = (boundary,)
        q += " ORDER BY submit_ns, rowid"
        with self._lock:
            rows = self._db.execute(q, args).fetchall()
        cols = list(zip(*rows)) if rows else [()] * _WIDTH
        counts, offs, toks = decode_events(cols[-2], cols[-1])
        start = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(counts, out=start[1:])
        return RecordBatch(
            **{c.name: from_python(c, v) for c, v in zip(COLUMNS, cols)},
            event_start=start,
            event_offsets_ns=offs,
            event_tokens=toks,
        )

    def records(self, boundary: str | None = None) -> list[RequestRecord]:
        """:meth:`batch` as row views."""
        return self.batch(boundary).records()

    def run_counts(self, run_id: str) -> dict[str, int]:
        """Records of one bench run (warm-ups left out) at each boundary: one SQL count."""
        with self._lock:
            rows = self._db.execute(
                "SELECT boundary, COUNT(*) FROM requests"
                " WHERE run_id = ? AND NOT COALESCE(warmup, 0) GROUP BY boundary",
                (run_id,),
            ).fetchall()
        return dict(rows)

    def count(self, boundary: str | None = None) -> int:
        with self._lock:
            if boundary:
                return self._db.execute("SELECT COUNT(*) FROM requests WHERE boundary = ?", (boundary,)).fetchone()[0]
            return self._db.execute("SELECT COUNT(*) FROM requests").fetchone()[0]

    def close(self) -> None:
        self._closing.set()
        if self._checkpointer is not None:
            self._checkpointer.join()
        with self._lock:
            self._db.close()  # the last connection to close checkpoints what is left


def open_existing(path: str) -> RequestStore:
    """A store that must already exist (readers: analyze, compare). Raises FileNotFoundError, or
    ValueError when the file is not a store."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such store")
    return RequestStore(path, readonly=True)


def store_paths(paths: str | Sequence[str]) -> list[str]:
    """The store files named: paths, or glob patterns (``shard-*.db``), each matching at least one."""
    import glob

    out: list[str] = []
    for p in [paths] if isinstance(paths, str) else paths:
        if any(ch in p for ch in "*?["):
            hits = sorted(glob.glob(p))
            if not hits:
                raise FileNotFoundError(f"{p}: no store matches")
            out += hits
        else:
            out.append(p)
    return list(dict.fromkeys(out))


def read_stores(paths: str | Sequence[str], boundary: str | None = None) -> tuple[RecordBatch, StepBatch]:
    """The records (at one boundary) and engine steps of one or several stores (the shards of
    several collectors), as one store holding them all would give them: records stored twice (the
    same request, boundary and end in two shards) once, in the order of one store (by submit,
    then trace, boundary and request id).

    A trace whose spans reached two collectors gives each the records of the boundaries it saw,
    derived there and not paired (``paired`` false): merged, they stay two unpaired records, as
    each collector counted them; pairing only happens where both halves of a trace were."""
    batches, steps = [], []
    for path in store_paths(paths):
        s = open_existing(path)
        try:
            batches.append(s.batch(boundary))
            steps.append(s.steps())
        finally:
            s.close()
    batch = RecordBatch.concat(batches)
    if len(batches) > 1:
        keys = list(zip(batch.end_ns.tolist(), batch.trace_id, batch.boundary, batch.request_id))
        first: dict = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        order = sorted(first.values(), key=lambda i: (int(batch.submit_ns[i]), keys[i][1], keys[i][2], keys[i][3]))
        batch = batch.take(order)
    return batch, StepBatch.concat(steps)


def load_timelines(path: str | Sequence[str], boundary: str, selection: Selection | None = None) -> TimelineBatch:
    """Entry point ``otel_llm.timeline_sources: store``: the records at one boundary of one store
    or several (:func:`read_stores`) that ``selection`` keeps (default: every run, warm-ups left
    out), in Unix seconds (and exact ns)."""
    return read_stores(path, boundary)[0].selected(selection).timelines(epoch_ns=0)
