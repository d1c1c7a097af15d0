"""The client TTFT's parts, declared once (docs/metrics/spec.md, "Where the time went").

Each part is an interval between two moments of one request; in the order they happen, they sum
exactly to the client's TTFT. Where a boundary is missing, finer parts give way to a coarser one
that says what it holds: a part's ``coarse`` is the part it is summed into there (``to_engine`` =
``client_send`` + ``network_in`` + ``api_in`` without the HTTP server span; ``delivery`` =
``api_out`` + ``network_out``). A disaggregated request's way to its decode engine went through a
proxy and a whole prefill leg, which is not network: its ``to_engine`` is ``to_prefill`` +
``prefill_leg`` + ``pd_hop`` (the parts marked ``disagg``) in place of the usual three. A part with
``held_by`` may be unknown on its own while its neighbour is known; the neighbour then holds its
time (``client_send`` in ``network_in`` for a client that does not say when it began writing;
``front_end`` in ``queue`` for an engine that does not say when it queued the request;
``kv_transfer`` and ``kv_ready`` in ``queue`` for any request but a disaggregated one's on a decode
engine that says when its KV fetch moved; ``front_end`` and ``queue`` both in ``front_end_queue``
for an engine span that gives the queue's length but not where it starts, vLLM's own).

Everything that names, orders, explains, colours, merges or corrects the parts reads this table:
the records' columns (``records.COLUMNS``: the store's), derivation's outer parts, ``compare`` (its
per-request fields and its clock-offset correction), the metrics registry's ``llm_ttft_part_seconds``
and its help, the command line's help, the report, Grafana and the table in
docs/metrics/breakdown.md (checked by a test). Adding a part is an entry here and its computation:
:func:`collector.pipeline.derive.pair_parts` for an outer one, the engine's phases
(:func:`collector.pipeline.derive.engine_phases`) for one of the engine's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Part:
    name: str
    begins: str  # the moment it starts
    ends: str  # the moment it ends
    holds: str  # what the interval contains
    color: str  # in the report's figures
    coarse: str | None = None  # the part that holds it where the boundary it needs is missing
    held_by: str | None = None  # the neighbour that holds it where it alone is unknown
    outer: bool = False  # computed from the pair of records (client and engine), not the engine's own spans
    optional: bool = False  # only some requests have it (a disaggregated one's): left out where unknown
    #: one of a disaggregated request's parts of its ``coarse`` part, in place of the usual ones: its way
    #: to the decode engine went through a proxy and a whole prefill leg, which is not network
    disagg: bool = False
    #: the clocks it spans: -1 from the client's to the server's or the engine's, +1 back, 0 one clock.
    #: ``compare`` adds ``clock_shift`` x the estimated offset (engine - client) to correct it.
    clock_shift: int = 0

    @property
    def meaning(self) -> str:
        """``begins -> ends: holds``, as the report and the column docs say it."""
        return f"{self.begins} -> {self.ends}: {self.holds}"


PARTS: tuple[Part, ...] = (
    Part(
        "client_send",
        "the caller's call",
        "the client library began writing the request",
        "building it, waiting for a pooled connection, connecting (needs a client that says when it sent, as "
        "otel-llm's do; without it network_in holds this)",
        "#5c5c5c",
        coarse="to_engine",
        held_by="network_in",
        outer=True,
    ),
    Part(
        "network_in",
        "the client began writing the request",
        "the HTTP server read its first bytes",
        "the kernels, the network, the server process waking (two clocks; needs the server span)",
        "#8c8c8c",
        coarse="to_engine",
        outer=True,
        clock_shift=-1,
    ),
    Part(
        "api_in",
        "the HTTP server read the first bytes",
        "engine arrival",
        "HTTP parsing, the wait for the API server's event loop (busy with other streams), its handler (needs "
        "the server span)",
        "#a0cfff",
        coarse="to_engine",
        outer=True,
    ),
    Part(
        "to_prefill",
        "client call",
        "the prefill engine's arrival",
        "a disaggregated request: the client library, the network, the proxy and the prefill server's HTTP in, "
        "not told apart (two clocks: the client's and the prefill engine's)",
        "#7c8c3c",
        coarse="to_engine",
        outer=True,
        optional=True,
        disagg=True,
        clock_shift=-1,
    ),
    Part(
        "prefill_leg",
        "the prefill engine's arrival",
        "its finish",
        "the prefill engine's leg, on its clock: its front end, its queue, the prompt's computation and the "
        "one token the proxy discards",
        "#2f54eb",
        coarse="to_engine",
        outer=True,
        optional=True,
        disagg=True,
    ),
    Part(
        "pd_hop",
        "the prefill engine's finish",
        "the decode engine's arrival",
        "the prefill server's answer to the proxy, the proxy, and the decode server's HTTP in (two clocks: the "
        "prefill engine's and the decode engine's)",
        "#a0d911",
        coarse="to_engine",
        outer=True,
        optional=True,
        disagg=True,
    ),
    Part(
        "to_engine",
        "client call",
        "engine arrival",
        "the client library, the network and the HTTP server in (two clocks); = client_send + network_in + api_in; "
        "a disaggregated request (pd_role): = to_prefill + prefill_leg + pd_hop, ending at the decode engine's "
        "arrival",
        "#8c8c8c",
        outer=True,
        clock_shift=-1,
    ),
    Part(
        "front_end",
        "engine arrival",
        "queued (llm.frontend)",
        "rendering, tokenization, the hand-off to the engine core (unknown where the engine does not say when it "
        "queued a request: the queue holds it)",
        "#c0c4cc",
        held_by="queue",
    ),
    Part(
        "queue",
        "queued",
        "first scheduled (llm.queue); a P/D decode engine: its KV load started",
        "waiting for the scheduler (in a client's parts, unknown where front_end_queue holds it)",
        "#e6a23c",
        held_by="front_end_queue",
    ),
    Part(
        "front_end_queue",
        "engine arrival",
        "first scheduled, placed as the engine's first output less its prefill",
        "the front end and the scheduler's queue, not separable with this source (vLLM's own span gives the "
        "queue's length, the engine record's queue, not where it starts), and the first token's hand-off back "
        "to the front end (about a millisecond); unknown where the engine says them apart (otel-llm's hooks)",
        "#d9b38c",
        optional=True,
    ),
    Part(
        "kv_transfer",
        "a P/D decode engine's KV load started",
        "its scheduler saw the transfer complete (llm.engine.kv_transfer)",
        "the KV cache's transfer from the prefill engine, its handshake included where there is one, to the "
        "scheduler's step that learnt of it (unknown elsewhere; where the engine does not say, the queue holds it)",
        "#f56c6c",
        held_by="queue",
        optional=True,
    ),
    Part(
        "kv_ready",
        "the KV transfer seen complete",
        "first scheduled",
        "the decode scheduler's next step taking the request up (unknown elsewhere; held by the queue likewise)",
        "#fab6b6",
        held_by="queue",
        optional=True,
    ),
    Part(
        "prefill",
        "first scheduled",
        "first token generated (llm.prefill)",
        "the prompt's computation, batch-mates included",
        "#409eff",
    ),
    Part(
        "api_out",
        "engine first token generated",
        "the first body chunk the HTTP server wrote after it",
        "detokenizing, the API server (needs the server span)",
        "#d3adf7",
        coarse="delivery",
        outer=True,
    ),
    Part(
        "network_out",
        "that chunk written",
        "client first token",
        "the HTTP server's and the client's buffering, the network (two clocks; needs the server span)",
        "#36cfc9",
        coarse="delivery",
        outer=True,
        clock_shift=1,
    ),
    Part(
        "delivery",
        "engine first token generated",
        "client first token",
        "the API server and the network (two clocks); = api_out + network_out",
        "#b37feb",
        outer=True,
        clock_shift=1,
    ),
)

NAMES: tuple[str, ...] = tuple(p.name for p in PARTS)
BY_NAME: dict[str, Part] = {p.name: p for p in PARTS}
OUTER: tuple[str, ...] = tuple(p.name for p in PARTS if p.outer)
COLORS: dict[str, str] = {p.name: p.color for p in PARTS}
MEANING: dict[str, str] = {p.name: p.meaning for p in PARTS}
#: The engine's own parts (from its phase spans), in order.
ENGINE: tuple[str, ...] = tuple(p.name for p in PARTS if not p.outer)


def _fine(coarse: str) -> tuple[Part, ...]:
    return tuple(p for p in PARTS if p.coarse == coarse and not p.disagg)


def _split(coarse: str) -> tuple[Part, ...]:
    """A disaggregated request's parts of ``coarse`` (to_engine: to_prefill, prefill_leg, pd_hop)."""
    return tuple(p for p in PARTS if p.coarse == coarse and p.disagg)


_COARSE = tuple(dict.fromkeys(p.coarse for p in PARTS if p.coarse))  # to_engine, delivery
#: The parts the HTTP server span gives (the finest level), and those that stand for them without it.
FINE: tuple[str, ...] = tuple(p.name for p in PARTS if p.name not in _COARSE and not p.disagg)
COARSE: tuple[str, ...] = _COARSE
#: A disaggregated request's parts in place of the usual ones of a coarse part.
DISAGG: tuple[str, ...] = tuple(p.name for p in PARTS if p.disagg)
#: The outer parts, each coarse part followed by the fine ones it holds (the store's column order).
OUTER_BY_COARSE: tuple[str, ...] = tuple(
    n for c in _COARSE for n in (c, *(f.name for f in _fine(c)), *(f.name for f in _split(c)))
)
TWO_CLOCKS: tuple[str, ...] = tuple(p.name for p in PARTS if p.clock_shift)


def sum_text(names: tuple[str, ...] = FINE) -> str:
    """``a + b + ...``, with a part that a neighbour may hold in brackets: how the docs and the help
    write the decomposition."""
    return " + ".join(f"[{n}]" if BY_NAME[n].held_by and BY_NAME[n].outer else n for n in names)


def finest(values: Mapping[str, float | None]) -> dict[str, float | None] | None:
    """One request's parts (name -> seconds) at the finest level known, in order: each coarse part's
    disaggregated parts where all are known (a disaggregated request's), else its fine parts where
    all those not held by a neighbour are known (a fine part held by one is left out where unknown),
    else the coarse part; every other part as it is (None where unknown and held by a neighbour).
    None when a side is not known at all."""
    out: dict[str, float | None] = {}
    for p in PARTS:
        if p.name in _COARSE:
            fine, split = _fine(p.name), _split(p.name)
            if split and all(values.get(f.name) is not None for f in split):
                out.update({f.name: values[f.name] for f in split})
            elif all(values.get(f.name) is not None for f in fine if f.held_by is None):
                out.update({f.name: values[f.name] for f in fine if values.get(f.name) is not None})
            elif values.get(p.name) is not None:
                out[p.name] = values[p.name]
            else:
                return None
        elif p.coarse is None:
            v = values.get(p.name)
            if v is not None:
                out[p.name] = v
                continue
            if p.held_by is None:
                if p.optional:  # a part only some requests have (a P/D one's, vLLM's own span's)
                    continue
                return None
            holder = _holder(p.name, values)
            if values.get(holder) is None:  # nothing holds it: this side is not known
                return None
            if not p.optional and not BY_NAME[holder].optional:
                out[p.name] = None  # kept, unknown: its neighbour holds it (front_end in the queue)
            # else inside a part only some requests have (front_end_queue): no part of its own here
    return {k: out[k] for k in NAMES if k in out}


def _holder(name: str, values: Mapping[str, float | None]) -> str:
    """The part that holds ``name`` where it is unknown: its ``held_by``, followed while that is
    unknown too (``front_end`` -> ``queue`` -> ``front_end_queue``); ``name`` itself if none."""
    h = BY_NAME[name].held_by
    while h is not None and values.get(h) is None and BY_NAME[h].held_by is not None:
        h = BY_NAME[h].held_by
    return name if h is None else h


def known_parts(values: Mapping[str, float | None]) -> dict[str, float]:
    """One request's parts where :func:`finest` cannot give them all (a side not known at all: a
    client that timed no first token): the parts known, in order, a coarse part left out where a
    fine part of it is known. They do not add up to anything; they are what is known."""
    fine_known = {p.coarse for p in PARTS if p.coarse and values.get(p.name) is not None}
    return {n: values[n] for n in NAMES if values.get(n) is not None and n not in fine_known}


def shown(columns: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """:func:`finest` over columns of many requests (float arrays, NaN unknown): for each part,
    where it is shown with a known value."""
    known = {n: np.isfinite(np.asarray(columns[n], dtype=float)) for n in NAMES}
    out = {}
    for c in _COARSE:
        fine, split = _fine(c), _split(c)
        at_split = np.logical_and.reduce([known[f.name] for f in split]) if split else np.zeros_like(known[c])
        at_fine = ~at_split & np.logical_and.reduce([known[f.name] for f in fine if f.held_by is None])
        out.update({f.name: at_split for f in split})
        out.update({f.name: at_fine & known[f.name] for f in fine})
        out[c] = ~at_split & ~at_fine & known[c]
    out.update({n: known[n] for n in NAMES if n not in out})
    return out
