"""What the collector derives: one record per request and boundary, declared once.

:data:`COLUMNS` is the schema of a derived request: each column's name, kind, unit and the value
that means "unknown". Everything else is built from it:

* :class:`RecordBatch`, many records columnar (numpy): what derivation produces and the store,
  the metrics registry and ``compare`` consume;
* :class:`RequestRecord`, the row view of one record (``None`` where a value is unknown);
* the store's SQLite columns and its reader (:mod:`collector.storage.store`).

Adding a derived value is one :class:`Column` here plus its computation in
:mod:`collector.pipeline.derive`. Plain data, no I/O (vLLM ``v1/metrics`` style). Points in time are integer
Unix **ns** (exact); durations are float **seconds**.

Token events are not columns: record ``i``'s events are ``event_offsets_ns[event_start[i]:
event_start[i + 1]]`` (int64 ns after submit, ascending, every event >= 1 token: derivation
enforces it where events enter) with ``event_tokens`` alike. :meth:`RecordBatch.timelines` is the
one bridge from records to the metric core (:mod:`otel_llm.metrics.request_math`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, make_dataclass
from typing import Any

import numpy as np

from otel_llm.metrics.selection import Selection
from otel_llm.metrics.timeline import STATUS_CODE, TimelineBatch
from otel_llm.semconv import Boundary, PairedBy

from .ttft_parts import ENGINE as ENGINE_PARTS
from .ttft_parts import MEANING, OUTER_BY_COARSE

NO_NS = np.iinfo(np.int64).min  # an unknown point in time in an int64 ns column


def seconds(ns: np.ndarray) -> np.ndarray:
    """int64 ns durations (NO_NS: unknown) -> float seconds (NaN)."""
    return np.where(ns != NO_NS, ns / 1e9, np.nan)


@dataclass(frozen=True)
class Kind:
    """How a column is held: in a batch (``dtype``, None: a Python list), in SQLite, and the batch
    value meaning "unknown" unless the column says otherwise."""

    dtype: Any
    sqlite: str
    unknown: Any


TEXT = Kind(None, "TEXT", None)
INT = Kind(np.int64, "INTEGER", None)  # always known unless the column names an unknown value
NS = Kind(np.int64, "INTEGER", NO_NS)  # a point in time, Unix ns
SECONDS = Kind(np.float64, "REAL", math.nan)  # a duration (SQLite stores NaN as NULL)
FRACTION = Kind(np.float64, "REAL", math.nan)  # a share, 0..1 (unknown: NaN, NULL in SQLite)
FLAG = Kind(np.bool_, "INTEGER", None)
WEIGHT = Kind(np.float64, "REAL", None)  # a multiplier, always known: 1 unless something says otherwise
RATIO = Kind(np.float64, "REAL", math.nan)  # a quotient of two counts (unknown: NaN, NULL in SQLite)


@dataclass(frozen=True)
class Column:
    name: str
    kind: Kind
    unit: str  # "s", "ns", "tokens", "" (a name or a count)
    doc: str
    unknown: Any = field(default=None)  # overrides the kind's "unknown" value (e.g. -1 tokens)

    @property
    def missing(self) -> Any:
        """The batch value meaning unknown (None: this column is always known)."""
        return self.kind.unknown if self.unknown is None else self.unknown

    @property
    def fill(self) -> Any:
        """What a batch holds for a row view's ``None``."""
        if self.missing is not None:
            return self.missing
        return {TEXT: None, FLAG: False, WEIGHT: 1.0}.get(self.kind, 0)


COLUMNS: tuple[Column, ...] = (
    Column("trace_id", TEXT, "", "the request's trace, 32 hex digits (a trace may hold many requests)"),
    Column(
        "caller_span_id",
        TEXT,
        "",
        "the span the call ran under, 16 hex digits: a client record's parent (the application's span: "
        "an agent's turn, a chain's step), and the same on the records paired with it; an unpaired engine "
        "record's: the span above its HTTP server span; None: a root span",
    ),
    Column("boundary", TEXT, "", "client | server | engine"),
    Column("request_id", TEXT, "", "the engine's request id (client: the id it sent or got back); #k for choice k"),
    Column("choice", INT, "", "a request with several choices (n > 1): this record's index", unknown=-1),
    Column("model", TEXT, "", "gen_ai.request.model, else the service name, else 'unknown'"),
    Column("service", TEXT, "", "service.name of the process that sent the span (None: not given)"),
    Column("status", TEXT, "", "ok | error | cancelled | rejected"),
    Column("run_id", TEXT, "", "the otel-llm bench run (llm.bench.run_id; an engine record: its client's)"),
    Column("warmup", FLAG, "", "a bench warm-up request: left out of every result unless asked for"),
    Column(
        "submit_ns", NS, "ns", "Unix ns. client: sent; server: the HTTP app got it; engine: arrived at the front end"
    ),
    Column("end_ns", NS, "ns", "Unix ns. client: stream closed; server: the app returned; engine: finished or aborted"),
    Column("input_tokens", INT, "tokens", "prompt tokens", unknown=-1),
    Column(
        "output_tokens",
        INT,
        "tokens",
        "N = sum of the tokens of every event, or the response's usage; None: the source did not say (a GenAI "
        "client span without usage), never 0",
        unknown=-1,
    ),
    Column("estimated_tokens", FLAG, "", "the client counted tokens itself rather than from usage"),
    Column(
        "events_summarised",
        FLAG,
        "",
        "the token events are the first and the last token only (from vLLM's own llm_request span): TTFT, E2E "
        "and mean TPOT known; ITL, the largest gap and stalls unknown",
    ),
    Column(
        "events_rejected", INT, "", "token events dropped as invalid (outside the span, or a token count out of range)"
    ),
    Column(
        "violations",
        TEXT,
        "",
        "the timeline orderings this record breaks, comma-separated (invariants.KINDS); unknown: none",
    ),
    # per-request metrics (docs/metrics/spec.md)
    Column("ttft", SECONDS, "s", "first token event - submit; unknown without a token"),
    Column("tpot", SECONDS, "s", "(last - first token event) / (N - 1); unknown for N <= 1, never 0"),
    Column("e2e", SECONDS, "s", "end - submit"),
    Column("itl_max", SECONDS, "s", "the largest gap between token events; unknown for fewer than two"),
    # engine internals (engine records; copied onto the paired client record)
    *(Column(name, SECONDS, "s", MEANING[name]) for name in ENGINE_PARTS),  # front_end, queue, prefill
    Column("decode", SECONDS, "s", "llm.decode: first token -> last token generated"),
    Column(
        "preemptions",
        INT,
        "",
        "llm.preemption spans; None: the engine's source does not say (vLLM's own spans, SGLang's)",
        unknown=-1,
    ),
    Column("preemption_time", SECONDS, "s", "total time preempted (0 without a preemption; None: not said)"),
    Column("first_scheduled_ns", NS, "ns", "Unix ns, engine clock"),
    Column("first_generated_ns", NS, "ns", "Unix ns, engine clock: first token generated (end of prefill)"),
    Column("engine_delivery", SECONDS, "s", "first token generated -> first output handed out"),
    # client TTFT decomposition (client records paired with an engine record)
    *(Column(name, SECONDS, "s", MEANING[name]) for name in OUTER_BY_COARSE),  # to_engine, its parts, delivery, ...
    Column("server_received_ns", NS, "ns", "Unix ns, server clock: the HTTP server received the request"),
    Column("server_first_chunk_ns", NS, "ns", "Unix ns, server clock: the first body chunk after the first token"),
    # the layers of the client's largest gap between token events (collector/pipeline/stalls.py)
    Column(
        "stall_core_gap",
        SECONDS,
        "s",
        "over the two tokens that bound the client's largest gap: the engine core's gap between generating "
        "them (needs an engine that says when it generated tokens)",
    ),
    Column(
        "stall_server_gap",
        SECONDS,
        "s",
        "over the same two tokens: the HTTP server's gap between writing them (needs the server span)",
    ),
    Column(
        "tokens_unread",
        INT,
        "tokens",
        "a paired request whose client gave up (client status cancelled), on both its records: the engine's "
        "output tokens the client never received (made after it left, or in flight when it did; what the "
        "engine made after the abort and dropped is tokens_after_abort)",
        unknown=-1,
    ),
    Column(
        "tokens_after_abort",
        INT,
        "tokens",
        "an aborted engine request (llm.usage.tokens_after_abort): tokens its engine generated after the abort, "
        "which nobody received (a step already under way when the abort came); unknown for any other request",
        unknown=-1,
    ),
    Column(
        "sample_weight",
        WEIGHT,
        "",
        "1 / the probability a sampler kept this request with (llm.sampling.probability, from this record's "
        "span or, for an engine or server record, its client's or its server's): what it counts for in rates "
        "and goodput; 1 without sampling or where the probability is not known",
    ),
    Column("paired", FLAG, "", "this request was seen at both boundaries, client and engine"),
    Column(
        "paired_by",
        TEXT,
        "",
        "how a paired record was paired: trace (one trace holds both boundaries) | id (a GenAI client's "
        "gen_ai.response.id is the engine's request id; its trace context did not reach the server)",
    ),
    Column("peer_request_id", TEXT, "", "the request id of the paired record at the other boundary"),
    Column("internal_id", TEXT, "", "an engine record: the engine's own request id (llm.request.internal_id)"),
    # speculative decoding, an engine record joined with its engine's account (llm.engine.speculation;
    # collector/pipeline/speculation.py); unknown without speculation or without the account
    Column("spec_method", TEXT, "", "how the engine drafted (vLLM: ngram, draft_model, eagle, ...)"),
    Column("draft_tokens", INT, "tokens", "draft tokens the engine verified for the request", unknown=-1),
    Column("accepted_tokens", INT, "tokens", "of them, accepted", unknown=-1),
    Column("verify_steps", INT, "", "the request's steps that verified drafts", unknown=-1),
    Column("acceptance_rate", FRACTION, "", "accepted / draft tokens (unknown where none were drafted)"),
    Column(
        "mean_acceptance_length",
        RATIO,
        "tokens",
        "tokens per verify step: 1 + accepted / verify steps (vLLM's mean acceptance length)",
    ),
    Column(
        "gap_step_draft_tokens",
        INT,
        "tokens",
        "the step that ended the request's largest gap between token events (its client's, on both records "
        "of a pair): the draft tokens it verified for the request (0: none); unknown without the engine's "
        "per-step account",
        unknown=-1,
    ),
    Column("gap_step_accepted_tokens", INT, "tokens", "of that step's draft tokens, those accepted", unknown=-1),
    # disaggregated prefill/decode (llm.pd.* on llm.request; collector/pipeline/disagg.py): the
    # decode engine's record, its prefill leg joined, and the client record paired with it
    Column(
        "pd_role",
        TEXT,
        "",
        "disaggregated: the request's prefill and decode legs joined into this record (the decode "
        "engine's, and its client's); prefill | decode: a leg whose other leg was not seen; both: an engine "
        "with a KV connector served it whole; None: not a P/D engine",
    ),
    Column("pd_connector", TEXT, "", "the KV connector that moved the request's KV cache (vLLM: NixlConnector, ...)"),
    Column("prefill_engine_id", TEXT, "", "the prefill leg's engine (llm.pd.engine_id)"),
    Column("prefill_request_id", TEXT, "", "the prefill engine's own id for the request (its internal id)"),
    Column("prefill_arrival_ns", NS, "ns", "Unix ns, the prefill engine's clock: its leg's arrival"),
    # prefill_leg (its arrival -> its finish) is a part of the client TTFT, among them above
    Column("prefill_leg_queue", SECONDS, "s", "the prefill leg's llm.queue (its scheduler's queue)"),
    Column("prefill_leg_prefill", SECONDS, "s", "the prefill leg's llm.prefill: the prompt computed there"),
    Column(
        "kv_blocks",
        INT,
        "",
        "a P/D decode engine: the KV blocks its load of the request asked for (llm.engine.kv_transfer)",
        unknown=-1,
    ),
    Column(
        "kv_load",
        TEXT,
        "",
        "a P/D decode engine's KV load of the request (llm.engine.kv_transfer): loaded (its scheduler saw "
        "it complete) | failed (its connector said so: vLLM's kv_load_failure_policy then failed the request, "
        "status error, or recomputed its prompt) | none (nothing to load: the prompt recomputed); None: no "
        "such account",
    ),
    Column(
        "kv_bytes",
        INT,
        "bytes",
        "a P/D decode engine: the bytes its load of the request moved, as the transport says (NIXL's "
        "telemetry, summed over the request's transfers; unknown for a connector that does not say)",
        unknown=-1,
    ),
    Column(
        "kv_wire",
        SECONDS,
        "s",
        "the transport's own time for those transfers (NIXL: xferDuration, summed), inside kv_transfer",
    ),
    Column(
        "kv_handshake",
        SECONDS,
        "s",
        "inside kv_transfer: the request's wait for its decode engine's handshake with a new prefill engine "
        "(NIXL: its metadata exchange, on the first requests from that peer), to the step that started its "
        "read; unknown for a request that waited for none",
    ),
    Column(
        "prefill_kv_hold",
        SECONDS,
        "s",
        "the prefill engine held the request's KV blocks for the decode engine: its finish -> the blocks freed "
        "(the decode side read them, or the connector's timeout passed; llm.engine.kv_hold)",
    ),
    Column(
        "prefill_leg_tokens",
        INT,
        "tokens",
        "tokens the prefill leg generated, which the proxy discards (1 with vLLM's proxies)",
        unknown=-1,
    ),
)
COLUMN_NAMES: tuple[str, ...] = tuple(c.name for c in COLUMNS)
EVENT_FIELDS = ("event_offsets_ns", "event_tokens")


def _concat(arrays: Sequence) -> np.ndarray:
    """Many int sequences as one int64 array."""
    return np.concatenate([np.asarray(x, np.int64) for x in arrays]) if len(arrays) else np.zeros(0, np.int64)


def to_python(col: Column, values, nan_as_none: bool = True) -> list:
    """A batch column as Python values, None where unknown (``nan_as_none=False`` leaves unknown
    seconds as NaN: SQLite stores a NaN as NULL)."""
    if col.kind.dtype is None:
        return list(values)
    out = values.tolist()
    missing = col.missing
    nan = col.kind.dtype is np.float64 and missing is not None
    if missing is None or (nan and not nan_as_none):
        return out
    if nan:
        return [None if v != v else v for v in out]
    return [None if v == missing else v for v in out]


def from_python(col: Column, values: Sequence) -> Any:
    """The inverse of :func:`to_python` (None -> the column's unknown value)."""
    fill = col.fill
    if col.kind.dtype is None:
        return list(values)
    return np.array([fill if v is None else v for v in values], col.kind.dtype)


def timeline_batch(
    ids: list[str],
    submit_ns: np.ndarray,
    end_ns: np.ndarray,
    status: Sequence[str],
    event_start: np.ndarray,
    event_offsets_ns: np.ndarray,
    event_tokens: np.ndarray,
    input_tokens: np.ndarray,
    epoch_ns: int | None = None,
    weight: np.ndarray | None = None,
    untimed_tokens: np.ndarray | None = None,
    summarised: np.ndarray | None = None,
    tokens_unknown: np.ndarray | None = None,
) -> TimelineBatch:
    """Records' columns as a :class:`TimelineBatch` for the metric core: seconds after
    ``epoch_ns`` (default: the earliest submit, which keeps every difference exact to well under a
    nanosecond; 0 gives Unix seconds). The events are taken as they are (already clean)."""
    n = len(submit_ns)
    epoch = (int(submit_ns.min()) if n else 0) if epoch_ns is None else epoch_ns
    rel = submit_ns - epoch
    counts = np.diff(event_start)
    return TimelineBatch(
        list(ids),
        rel / 1e9,
        (end_ns - epoch) / 1e9,
        np.fromiter(map(STATUS_CODE.__getitem__, status), np.int8, n),
        event_start,
        (np.repeat(rel, counts) + event_offsets_ns) / 1e9,
        event_tokens,
        input_tokens,
        submit_ns,
        end_ns,
        event_offsets_ns,
        None if weight is None or not (np.asarray(weight) != 1.0).any() else np.asarray(weight, np.float64),
        None if untimed_tokens is None or not np.asarray(untimed_tokens).any() else untimed_tokens,
        summarised=None if summarised is None or not np.asarray(summarised).any() else np.asarray(summarised, bool),
        tokens_unknown=None
        if tokens_unknown is None or not np.asarray(tokens_unknown).any()
        else np.asarray(tokens_unknown, bool),
    )


class _BatchMethods:
    """The behaviour of :class:`RecordBatch` (its fields come from :data:`COLUMNS`)."""

    #: (client rows, engine rows) of the requests paired in this batch, as derivation found them;
    #: None for a batch from anywhere else (a store, a file)
    pairs: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.trace_id)

    def timelines(self, epoch_ns: int | None = None) -> TimelineBatch:
        """The batch as the metric core's input (see :func:`timeline_batch`); ids are the
        request ids; with the count of records that break the timeline invariants, by kind."""
        kinds = Counter(k for v in self.violations if v for k in v.split(","))
        tb = timeline_batch(
            self.request_id,
            self.submit_ns,
            self.end_ns,
            self.status,
            self.event_start,
            self.event_offsets_ns,
            self.event_tokens,
            self.input_tokens,
            epoch_ns,
            self.sample_weight,
            np.where(np.diff(self.event_start) == 0, np.maximum(self.output_tokens, 0), 0),  # a response not streamed
            self.events_summarised,
            self.output_tokens < 0,
        )
        tb.violations = {"records": sum(1 for v in self.violations if v), **dict(sorted(kinds.items()))}
        return tb

    def scalar_columns(self, nan_as_none: bool = True) -> dict[str, list]:
        """Every column as Python values, in :data:`COLUMNS` order (see :func:`to_python`)."""
        return {c.name: to_python(c, getattr(self, c.name), nan_as_none) for c in COLUMNS}

    def take(self, indices: Sequence[int] | np.ndarray) -> RecordBatch:
        """The records at ``indices`` (in that order), as a new batch, with the pairs of this batch
        whose two records it holds (renumbered)."""
        idx = np.asarray(indices, np.int64)
        st = self.event_start
        counts = st[idx + 1] - st[idx]
        start = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(counts, out=start[1:])
        ev = np.repeat(st[idx] - start[:-1], counts) + np.arange(int(start[-1]))
        picked = idx.tolist()
        cols = {}
        for c in COLUMNS:
            v = getattr(self, c.name)
            cols[c.name] = [v[i] for i in picked] if c.kind.dtype is None else v[idx]
        out = type(self)(
            **cols, event_start=start, event_offsets_ns=self.event_offsets_ns[ev], event_tokens=self.event_tokens[ev]
        )
        if self.pairs is not None:
            where = np.full(len(self), -1, np.int64)
            where[idx] = np.arange(len(idx))
            ci, ei = where[self.pairs[0]], where[self.pairs[1]]
            both = (ci >= 0) & (ei >= 0)
            out.pairs = (ci[both], ei[both])
        return out

    def selected(self, sel: Selection | None) -> RecordBatch:
        """The records ``sel`` keeps (warm-ups left out unless it includes them)."""
        if sel is None:
            sel = Selection()
        keep = np.ones(len(self), bool)
        if not sel.include_warmup:
            keep &= ~self.warmup
        if sel.runs:
            keep &= np.fromiter((r in sel.runs for r in self.run_id), bool, len(self))
        if sel.services:
            keep &= np.fromiter((s in sel.services for s in self.service), bool, len(self))
        if sel.traces:
            in_trace = np.fromiter((t in sel.traces for t in self.trace_id), bool, len(self))
            keep &= in_trace | self._paired_by_id_with(in_trace)
        if sel.since_ns is not None:
            keep &= self.submit_ns >= sel.since_ns
        if sel.until_ns is not None:
            keep &= self.submit_ns <= sel.until_ns
        return self if keep.all() else self.take(np.flatnonzero(keep))

    def _paired_by_id_with(self, clients: np.ndarray) -> np.ndarray:
        """The engine and server records of the requests whose client records (of ``clients``)
        were paired by id: a trace's calls whose trace context did not reach the server are the
        trace's requests all the same, though their engine's records are in traces of their own."""
        b, how, rid = self.boundary, self.paired_by, self.request_id
        ids = {
            p
            for p, bb, hh, k in zip(self.peer_request_id, b, how, clients.tolist())
            if k and bb == Boundary.CLIENT and hh == PairedBy.ID
        }
        if not ids:
            return np.zeros(len(self), bool)
        engine = [bb == Boundary.ENGINE and hh == PairedBy.ID and r in ids for bb, hh, r in zip(b, how, rid)]
        traces = {t for t, e in zip(self.trace_id, engine) if e}
        server = (bb == Boundary.SERVER and r in ids and t in traces for bb, r, t in zip(b, rid, self.trace_id))
        return np.fromiter((e or s for e, s in zip(engine, server)), bool, len(self))

    def at_boundary(self, boundary: str) -> RecordBatch:
        """The records of one boundary."""
        return self.take([i for i, b in enumerate(self.boundary) if b == boundary])

    def records(self) -> list[RequestRecord]:
        """The row view of every record (Python values; events as lists)."""
        cols = self.scalar_columns()
        st = self.event_start.tolist()
        offs, toks = self.event_offsets_ns.tolist(), self.event_tokens.tolist()
        return [
            RequestRecord(**dict(zip(COLUMN_NAMES, values)), event_offsets_ns=offs[a:b], event_tokens=toks[a:b])
            for values, a, b in zip(zip(*cols.values()), st[:-1], st[1:])
        ]

    @classmethod
    def from_columns(cls, columns: dict[str, Sequence], offsets: Sequence, tokens: Sequence) -> RecordBatch:
        """A batch from Python column values (None where unknown) and each record's event lists."""
        counts = [len(o) for o in offsets]
        start = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=start[1:])
        return cls(
            **{c.name: from_python(c, columns[c.name]) for c in COLUMNS},
            event_start=start,
            event_offsets_ns=_concat(offsets),
            event_tokens=_concat(tokens),
        )

    @classmethod
    def concat(cls, batches: Sequence[RecordBatch]) -> RecordBatch:
        """The records of several batches, one after the other."""
        if len(batches) == 1:
            return batches[0]
        cols = {}
        for c in COLUMNS:
            parts = [getattr(b, c.name) for b in batches]
            cols[c.name] = [v for p in parts for v in p] if c.kind.dtype is None else np.concatenate(parts)
        counts = np.concatenate([np.diff(b.event_start) for b in batches]) if batches else np.zeros(0, np.int64)
        start = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=start[1:])
        return cls(
            **cols,
            event_start=start,
            event_offsets_ns=np.concatenate([b.event_offsets_ns for b in batches]),
            event_tokens=np.concatenate([b.event_tokens for b in batches]),
        )

    @classmethod
    def from_records(cls, records: Sequence[RequestRecord]) -> RecordBatch:
        """The inverse of :meth:`records`."""
        cols = {name: [getattr(r, name) for r in records] for name in COLUMN_NAMES}
        return cls.from_columns(cols, [r.event_offsets_ns for r in records], [r.event_tokens for r in records])


class _RecordMethods:
    """The behaviour of :class:`RequestRecord` (its fields come from :data:`COLUMNS`)."""

    @property
    def submit(self) -> float:
        """Unix seconds."""
        return self.submit_ns / 1e9

    @property
    def end(self) -> float:
        """Unix seconds."""
        return self.end_ns / 1e9

    @property
    def event_times(self) -> list[float]:
        """Token event times, Unix seconds."""
        return [(self.submit_ns + int(o)) / 1e9 for o in self.event_offsets_ns]

    @property
    def first_event_ns(self) -> int | None:
        """Unix ns of the first token event (None without one)."""
        return self.submit_ns + int(self.event_offsets_ns[0]) if len(self.event_offsets_ns) else None


def _batch_type(c: Column) -> type:
    return list if c.kind.dtype is None else np.ndarray


def _row_type(c: Column) -> Any:
    base = {TEXT: str, INT: int, NS: int, SECONDS: float, FLAG: bool, WEIGHT: float}[c.kind]
    return base if c.missing is None and c.kind is not TEXT else base | None


def _row_default(c: Column) -> Any:
    return None if c.missing is not None or c.kind is TEXT else c.fill


RecordBatch = make_dataclass(
    "RecordBatch",
    [(c.name, _batch_type(c)) for c in COLUMNS]
    + [("event_start", np.ndarray), ("event_offsets_ns", np.ndarray), ("event_tokens", np.ndarray)],
    bases=(_BatchMethods,),
    namespace={"__module__": __name__},
    eq=False,
)
RecordBatch.__doc__ = (
    "Many derived records, columnar: one field per :data:`COLUMNS` entry (numpy arrays, lists for "
    "text; unknown values as each column says: NaN, NO_NS, -1) plus the token events (event_start[n + 1], "
    "event_offsets_ns, event_tokens)."
)

RequestRecord = make_dataclass(
    "RequestRecord",
    [(c.name, _row_type(c), field(default=_row_default(c))) for c in COLUMNS]
    + [(name, Sequence[int], field(default_factory=list)) for name in EVENT_FIELDS],
    bases=(_RecordMethods,),
    namespace={"__module__": __name__},
)
RequestRecord.__doc__ = (
    "One derived record, the row view of a :class:`RecordBatch`: one field per :data:`COLUMNS` entry "
    "(None where unknown) plus its token events (offsets ns after submit, ascending; tokens per event)."
)
