"""``otel-llm bench --replay``: the arrivals and lengths of a recorded workload, to send again.

Sources (found from the file's first bytes, or named by ``--replay-format``):

* ``store``: the collector's store (SQLite); its client records (else its engine records), one run
  or all (warm-ups left out);
* ``traces``: an OTLP JSON-lines trace file (``OTEL_LLM_TRACES_FILE``), its client spans (else its
  engine request spans);
* ``timelines``: the timelines file of ``otel-llm bench --output`` / ``analyze``;
* ``mooncake``: Mooncake's JSONL trace: ``timestamp`` (ms after the trace's start),
  ``input_length``, ``output_length`` and ``hash_ids`` (one id per block of ``block_size`` prompt
  tokens, 512 in Mooncake; the same id, the same block: shared prefixes).

The store and the trace file are read through the ``otel_llm.timeline_sources`` entry points (the
collector package), as ``analyze --store`` reads them. Prompts are token ids (the completions API
takes them as they are), so the input length is the recorded one on any tokenizer; each hash id's
block is the same ids every time it appears (drawn from a generator seeded by the id), so blocks
shared in the trace are shared prefixes on the server. Times: seconds after the first arrival,
divided by the speed factor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from ..metrics.selection import Selection
from ..metrics.timeline import TimelineBatch
from ..metrics.timeline_file import read_timelines
from ..semconv import Boundary

FORMATS = ("auto", "store", "traces", "timelines", "mooncake")
MOONCAKE_BLOCK = 512


@dataclass(frozen=True)
class ReplayItem:
    offset_s: float  # seconds after the first recorded arrival, before the speed factor
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass
class Replay:
    """A recorded workload: its requests in arrival order."""

    items: list[ReplayItem]
    source: str
    format: str
    speed: float = 1.0
    block_size: int = MOONCAKE_BLOCK
    note: str = ""

    def __post_init__(self) -> None:
        if not self.items:
            raise ValueError(f"{self.source}: no request to replay")
        if not self.speed > 0:
            raise ValueError("the replay speed factor must be > 0")
        self.items.sort(key=lambda r: r.offset_s)

    def offsets(self) -> np.ndarray:
        """Intended send times, seconds after the run's start (the speed factor applied)."""
        t = np.array([r.offset_s for r in self.items], dtype=float)
        return (t - t[0]) / self.speed

    def prompt(self, i: int, rng: np.random.Generator, vocab: int) -> list[int]:
        """Request ``i``'s prompt: its hash blocks (the same ids for the same hash), then ids from
        ``rng`` up to its input length. Ids are drawn from 10 to ``vocab`` - 1."""
        r = self.items[i]
        ids: list[int] = []
        for h in r.hash_ids:
            if len(ids) >= r.input_tokens:
                break
            block = np.random.default_rng([h & (2**63 - 1), 0x5EED]).integers(10, vocab, self.block_size)
            ids.extend(block.tolist())
        ids = ids[: r.input_tokens]
        if len(ids) < r.input_tokens:
            ids.extend(rng.integers(10, vocab, r.input_tokens - len(ids)).tolist())
        return ids

    def describe(self) -> dict:
        t = self.offsets()
        return {
            "replay_source": os.path.basename(self.source),
            "replay_format": self.format,
            "replay_speed": self.speed,
            "replay_requests": len(self.items),
            "replay_span_s": float(t[-1]),
        }


def detect(path: str) -> str:
    """The format of ``path`` from its first bytes (ValueError when it is none of them)."""
    with open(path, "rb") as fh:
        head = fh.read(16)
        if head.startswith(b"SQLite format 3\x00"):
            return "store"
        fh.seek(0)
        for raw in fh:
            line = raw.strip()
            if line:
                break
        else:
            raise ValueError(f"{path}: empty")
    try:
        first = json.loads(line)
    except ValueError:
        raise ValueError(f"{path}: neither a store nor JSON lines") from None
    if isinstance(first, dict):
        if "resourceSpans" in first:
            return "traces"
        if "timestamp" in first and "input_length" in first:
            return "mooncake"
        if "submit" in first:
            return "timelines"
    raise ValueError(f"{path}: not a store, an OTLP trace file, a timelines file or a Mooncake trace")


def from_timelines(batch: TimelineBatch) -> list[ReplayItem]:
    """Arrivals and lengths of recorded timelines: output length = the tokens the request got."""
    if not len(batch):
        return []
    cum = np.concatenate([[0], np.cumsum(batch.event_tokens, dtype=np.int64)])
    out_tokens = cum[batch.offsets[1:]] - cum[batch.offsets[:-1]]
    t0 = float(batch.submit.min()) if batch.submit_ns is None else None
    items = []
    for i in range(len(batch)):
        if batch.submit_ns is not None:
            off = (int(batch.submit_ns[i]) - int(batch.submit_ns.min())) / 1e9
        else:
            off = float(batch.submit[i]) - t0
        n_out = int(out_tokens[i])
        n_in = int(batch.input_tokens[i])
        if n_in < 1:
            raise ValueError(f"request {batch.ids[i]!r} has no input length: it cannot be replayed")
        items.append(ReplayItem(off, n_in, max(n_out, 1)))
    return items


def read_mooncake(path: str) -> list[ReplayItem]:
    """Mooncake's JSONL: ``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``."""
    items = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                ts, n_in, n_out = float(d["timestamp"]), int(d["input_length"]), int(d["output_length"])
                hashes = tuple(int(h) for h in d.get("hash_ids") or ())
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake record ({exc})") from None
            if not (np.isfinite(ts) and ts >= 0 and n_in >= 1 and n_out >= 1):
                raise ValueError(f"{path}:{n}: needs timestamp >= 0 and lengths >= 1")
            items.append(ReplayItem(ts / 1000.0, n_in, n_out, hashes))
    return items


def load(
    path: str,
    fmt: str = "auto",
    speed: float = 1.0,
    run: str | None = None,
    block_size: int = MOONCAKE_BLOCK,
    source_loader=None,
) -> Replay:
    """The workload recorded in ``path``. ``run``: one bench run of a store or trace file.
    ``source_loader(name)`` gives a timeline source's ``load(path, boundary, selection)`` (the
    CLI's entry-point lookup)."""
    if fmt == "auto":
        fmt = detect(path)
    note = ""
    if fmt == "mooncake":
        items = read_mooncake(path)
    elif fmt == "timelines":
        items = from_timelines(read_timelines(path))
    elif fmt in ("store", "traces"):
        if source_loader is None:
            raise ValueError(f"reading a {fmt} needs the collector package")
        sel = Selection(runs=(run,) if run else ())
        batch = source_loader(fmt)(path, Boundary.CLIENT, sel)
        if not len(batch):
            batch = source_loader(fmt)(path, Boundary.ENGINE, sel)
            note = "no client records: replaying the engine's (arrival at the engine)"
        items = from_timelines(batch)
    else:
        raise ValueError(f"unknown replay format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if run and fmt not in ("store", "traces"):
        raise ValueError("--replay-run selects from a store or a traces file")
    return Replay(items, path, fmt, speed, block_size, note)
