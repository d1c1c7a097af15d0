"""The client boundary from a load generator's own per-request results: bring your own load tool.

``otel-llm compare --client-results FILE`` (and ``report``) take the client's side of each request
from what the tool saved, in place of otel-llm's client spans, and join it to the server and engine
records of the store by the request id the tool sent (``x-request-id``; vLLM makes it its request
id, ``cmpl-<id>-0`` for completions, ``chatcmpl-<id>`` for chat). The parts are computed as for
otel-llm's own client (:func:`collector.pipeline.derive.pair_parts`), with the tool's clock as the client's.

Read here:

* ``vllm bench serve --save-result --save-detailed`` (vLLM 0.11 and later, where ``start_times``
  is saved): per request, in request order, ``start_times`` (``time.perf_counter()``: this host's
  CLOCK_MONOTONIC, seconds), ``ttfts``, ``itls`` (the gaps between the chunks after the first),
  ``latencies``, ``output_lens`` and ``errors``. Request ``i`` was sent as ``<prefix><i>``, where
  the prefix is ``--request-id-prefix`` (by default ``bench-<8 hex>-``, not saved in the file):
  found in the store as the prefix under which most of the file's requests are present, or given.
  What it lacks: the moment the request was written (``client_send`` is unknown, ``network_in``
  holds the client library's time before its send), and the tokens of each chunk (a chunk counts
  one token; the last takes the rest of ``output_lens``, and such a record is ``estimated``).

* guidellm ``run --output kind=json`` (0.8): ``benchmarks[].requests.successful`` (and
  ``errored``), each with ``response_id``, the id the server gave its response (vLLM's
  ``cmpl-<id>``; its engine record is ``cmpl-<id>-0``), which is what joins it (guidellm sends no
  request id of its own), and ``info.timings`` in Unix seconds: ``request_start``,
  ``first_token_iteration``, ``last_token_iteration``, ``request_end``; TTFT is
  ``first_token_iteration - request_start``, as guidellm's own ``time_to_first_token_ms``. What
  it lacks: when the request was written (``client_send`` unknown, as for vLLM's tool), and the
  time of each chunk between the first and the last (the record has two token events: one token
  at the first chunk, the rest at the last; ``estimated``, and its ITL is not per token).

Clocks: a tool that ran on the store's host reads ``monotonic`` (converted with this host's anchor
between CLOCK_MONOTONIC and the wall clock, which the servers' spans used); compare's clock-offset
estimate then finds the remaining offset (0 on one host) or corrects it for another host.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from otel_llm.metrics.request_math import request_metrics
from otel_llm.semconv import Boundary, RequestStatus

from ..pipeline import disagg
from ..pipeline.derive import FROM_ENGINE, PAIR_PARTS, pair_parts
from ..pipeline.records import NO_NS, RecordBatch, RequestRecord, timeline_batch

FORMATS = ("vllm-bench", "guidellm")

#: what a client record takes from its engine record (engine internals and the server's times)
#: what a tool's request takes from its engine record: what otel-llm's client record takes
_FROM_ENGINE = (*FROM_ENGINE, *disagg.FROM_ENGINE, "kv_load", "model", "input_tokens")


@dataclass
class ToolRequest:
    """One request as the load tool saw it. Times in seconds on the tool's clock."""

    index: int  # its place in the tool's results; with a prefix, the request id the tool sent
    start_s: float
    ttft_s: float | None  # None: no token arrived
    gaps_s: list[float] = field(default_factory=list)  # between the chunks after the first
    latency_s: float | None = None
    output_tokens: int = 0
    error: str = ""
    tool_id: str = ""  # the tool's own name for the request, when it has one
    response_id: str = ""  # the id the server gave the response, when the tool saved it


@dataclass
class ToolResults:
    tool: str
    requests: list[ToolRequest]
    clock: str  # "monotonic": this host's CLOCK_MONOTONIC; "unix": Unix seconds
    by_response_id: bool = False  # joined by response_id, not by <prefix><index>


def _read_json(path: str):
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None


def read_vllm_bench(path: str) -> ToolResults:
    """``vllm bench serve --save-result --save-detailed`` output (see the module's docstring)."""
    d = _read_json(path)
    need = ("start_times", "ttfts", "itls", "latencies", "output_lens")
    missing = [k for k in need if not isinstance(d, dict) or not isinstance(d.get(k), list)]
    if missing:
        raise ValueError(
            f"{path}: not vllm bench serve's detailed result (no {', '.join(missing)}): run it with "
            "--save-result --save-detailed (vLLM 0.11 or later saves start_times)"
        )
    n = len(d["start_times"])
    if any(len(d[k]) != n for k in need):
        raise ValueError(f"{path}: the per-request lists differ in length")
    errors = d.get("errors") or [""] * n
    reqs = []
    for i in range(n):
        err = errors[i] if i < len(errors) and errors[i] else ""
        ttft = d["ttfts"][i]
        ok = not err and isinstance(ttft, (int, float)) and ttft > 0
        reqs.append(
            ToolRequest(
                index=i,
                start_s=float(d["start_times"][i]),
                ttft_s=float(ttft) if ok else None,
                gaps_s=[float(g) for g in (d["itls"][i] or [])] if ok else [],
                latency_s=float(d["latencies"][i]) if ok else None,
                output_tokens=int(d["output_lens"][i] or 0),
                error=str(err)[:500],
            )
        )
    return ToolResults("vllm bench serve", reqs, "monotonic")


def read_guidellm(path: str) -> ToolResults:
    """guidellm's JSON report (``--output kind=json``; see the module's docstring)."""
    d = _read_json(path)
    benches = d.get("benchmarks") if isinstance(d, dict) else None
    if not isinstance(benches, list) or not all(isinstance(b, dict) and "requests" in b for b in benches):
        raise ValueError(
            f"{path}: not guidellm's JSON report (no benchmarks[].requests): run it with --output kind=json"
        )
    reqs: list[ToolRequest] = []
    for b in benches:
        for kind in ("successful", "errored", "incomplete"):
            for r in (b["requests"] or {}).get(kind) or []:
                reqs.append(_guidellm_request(len(reqs), r, kind))
    return ToolResults("guidellm", reqs, "unix", by_response_id=True)


def _guidellm_request(index: int, r: dict, kind: str) -> ToolRequest:
    t = (r.get("info") or {}).get("timings") or {}
    start, first, last, end = (
        t.get(k) for k in ("request_start", "first_token_iteration", "last_token_iteration", "request_end")
    )
    err = "" if kind == "successful" else str((r.get("info") or {}).get("error") or kind)[:500]
    ok = not err and isinstance(start, (int, float)) and isinstance(first, (int, float)) and first > start
    gaps = [float(last) - float(first)] if ok and isinstance(last, (int, float)) and last > first else []
    return ToolRequest(
        index=index,
        start_s=float(start or 0.0),
        ttft_s=float(first) - float(start) if ok else None,
        gaps_s=gaps,
        latency_s=float(end) - float(start) if ok and isinstance(end, (int, float)) else None,
        output_tokens=int((r.get("output_metrics") or {}).get("text_tokens") or r.get("output_tokens") or 0),
        error=err,
        tool_id=str(r.get("request_id") or ""),
        response_id=str(r.get("response_id") or ""),
    )


_READERS = {"vllm-bench": read_vllm_bench, "guidellm": read_guidellm}


def read_results(path: str, fmt: str = "vllm-bench") -> ToolResults:
    if fmt not in _READERS:
        raise ValueError(f"--client-results-format: one of {', '.join(FORMATS)}")
    return _READERS[fmt](path)


_VLLM_ID = re.compile(r"^(?:chat)?cmpl-(.*?)(?:-0)?$")


def _sent_id(engine_id: str) -> str:
    """The id a client sent, from vLLM's request id (``cmpl-<id>-0``, ``chatcmpl-<id>``)."""
    m = _VLLM_ID.match(engine_id)
    return m.group(1) if m else engine_id


def prefix_votes(n: int, sent_ids: list[str]) -> Counter:
    """For each prefix, how many of requests ``0..n-1`` appear under it among ``sent_ids`` (ids of
    the form ``<prefix><i>``)."""
    votes: Counter = Counter()
    for s in sent_ids:
        m = re.match(r"^(.*?)(\d+)$", s)
        if m and int(m.group(2)) < n:
            votes[m.group(1)] += 1
    return votes


def find_prefix(results: ToolResults, by_sent: dict[str, RequestRecord]) -> str:
    """The prefix the tool sent its requests under (``<prefix><index>``): the one under which most
    of them are in the store. Where several runs of the same size are (the same counts under two
    prefixes), the one whose engine arrivals lie nearest the tool's own send times (median
    distance, at least 10 times nearer than the next); raises ValueError when none, or when that
    does not decide."""
    n = len(results.requests)
    votes = prefix_votes(n, list(by_sent))
    if not votes:
        raise ValueError(
            f"none of the {n} requests of the {results.tool} results is in the store "
            "(no engine record with a request id <prefix><index>)"
        )
    best = votes.most_common(1)[0][1]
    tied = sorted(p for p, v in votes.items() if v == best)
    if len(tied) == 1:
        return tied[0]
    shift = _to_unix_ns(results)
    distance = {}
    for p in tied:
        d = [
            abs(by_sent[f"{p}{t.index}"].submit_ns - (round(t.start_s * 1e9) + shift))
            for t in results.requests
            if f"{p}{t.index}" in by_sent
        ]
        distance[p] = float(np.median(d))
    near = sorted(tied, key=distance.get)
    if distance[near[1]] >= 10 * max(distance[near[0]], 1e6):
        return near[0]
    raise ValueError(
        f"the {results.tool} results' {n} requests are in the store under several prefixes "
        f"({', '.join(tied)}): say which with --client-id-prefix"
    )


def _to_unix_ns(results: ToolResults) -> int:
    """What to add to the tool's clock (ns) to make Unix ns."""
    if results.clock == "monotonic":
        return time.time_ns() - time.monotonic_ns()
    return 0


def join_client(results: ToolResults, batch: RecordBatch, prefix: str | None = None) -> tuple[RecordBatch, str, int]:
    """The store's records with the tool's requests as the client boundary: a client record per
    tool request whose engine record is found (by the response id the tool saved, else by
    ``<prefix><index>`` sent), paired with it; the store's own client records are left out.
    Returns (records, how they were joined, tool requests not found)."""
    engines = [r for r in batch.records() if r.boundary == Boundary.ENGINE]
    by_sent: dict[str, RequestRecord] = {}
    for e in engines:
        by_sent.setdefault(_sent_id(e.request_id), e)
    n = len(results.requests)
    if results.by_response_id:
        keys = [_sent_id(t.response_id) if t.response_id else None for t in results.requests]
        ids = [t.tool_id or t.response_id or str(t.index) for t in results.requests]
        how = "the response id the server returned"
    else:
        if prefix is None:
            prefix = find_prefix(results, by_sent)
        keys = ids = [f"{prefix}{t.index}" for t in results.requests]
        how = f"request id {prefix}<i>"
    found = [(t, by_sent.get(k) if k else None, i) for t, k, i in zip(results.requests, keys, ids)]
    matched = [(t, e, i) for t, e, i in found if e is not None]
    if not matched:
        raise ValueError(f"none of the {n} requests of the {results.tool} results is in the store (joined by {how})")
    clients = _client_records(matched, _to_unix_ns(results))
    peers = {e.request_id: c.request_id for c, (_, e, _) in zip(clients, matched)}
    rest = [
        replace(r, paired=True, peer_request_id=peers[r.request_id])
        if r.boundary == Boundary.ENGINE and r.request_id in peers
        else r
        for r in batch.records()
        if r.boundary != Boundary.CLIENT
    ]
    return RecordBatch.from_records(clients + rest), how, n - len(matched)


def _client_records(matched: list[tuple[ToolRequest, RequestRecord, str]], shift_ns: int) -> list:
    """The client records of the matched tool requests (see :func:`join_client`)."""
    k = len(matched)
    if not k:
        return []
    submit = np.array([round(t.start_s * 1e9) + shift_ns for t, _, _ in matched], np.int64)
    end = submit.copy()
    starts, offs, toks = [0], [], []
    for j, (t, _, _) in enumerate(matched):
        if t.ttft_s is not None:
            at = np.cumsum([t.ttft_s, *t.gaps_s])
            o = np.round(at * 1e9).astype(np.int64)
            ones = np.ones(len(o), np.int64)
            ones[-1] += max(t.output_tokens - len(o), 0)
            offs.append(o)
            toks.append(ones)
            end[j] += max(round((t.latency_s or 0) * 1e9), int(o[-1]))
        starts.append(starts[-1] + (len(offs[-1]) if t.ttft_s is not None else 0))
    event_start = np.array(starts, np.int64)
    offsets = np.concatenate(offs) if offs else np.zeros(0, np.int64)
    tokens = np.concatenate(toks) if toks else np.zeros(0, np.int64)
    status = [RequestStatus.ERROR if t.error or t.ttft_s is None else RequestStatus.OK for t, _, _ in matched]
    ids = [i for _, _, i in matched]
    inputs = np.array([e.input_tokens if e.input_tokens is not None else -1 for _, e, _ in matched], np.int64)
    rm = request_metrics(timeline_batch(ids, submit, end, status, event_start, offsets, tokens, inputs))
    has = np.diff(event_start) > 0
    first = np.full(k, NO_NS, np.int64)
    first[has] = submit[has] + offsets[event_start[:-1][has]]
    parts = _parts_of(matched, submit, first)
    out = []
    for j, (_, e, _) in enumerate(matched):
        a, b = int(event_start[j]), int(event_start[j + 1])
        fields = {name: getattr(e, name) for name in _FROM_ENGINE}
        fields.update({p: None if parts[p][j] != parts[p][j] else float(parts[p][j]) for p in PAIR_PARTS})
        out.append(
            replace(
                e,
                **fields,
                boundary=Boundary.CLIENT,
                request_id=ids[j],
                status=status[j],
                submit_ns=int(submit[j]),
                end_ns=int(end[j]),
                event_offsets_ns=offsets[a:b].tolist(),
                event_tokens=tokens[a:b].tolist(),
                output_tokens=int(rm.output_tokens[j]),
                estimated_tokens=bool(b - a) and int(tokens[a:b].sum()) != b - a,
                ttft=_f(rm.ttft[j]),
                tpot=_f(rm.tpot[j]),
                e2e=_f(rm.e2e[j]),
                itl_max=_f(rm.itl_max[j]),
                violations=None,
                events_rejected=0,
                stall_core_gap=None,
                stall_server_gap=None,
                tokens_unread=-1,
                tokens_after_abort=-1,
                paired=True,
                peer_request_id=e.request_id,
                service=None,
            )
        )
    return out


def _parts_of(matched: list[tuple[ToolRequest, RequestRecord, str]], submit: np.ndarray, first: np.ndarray) -> dict:
    """The outer TTFT parts of the tool's requests (``submit``, ``first``: their call and first
    token, Unix ns) against their engine records, as for otel-llm's own client."""
    k = len(matched)
    ns = lambda name: np.array(
        [NO_NS if getattr(e, name) is None else getattr(e, name) for _, e, _ in matched], np.int64
    )
    e_submit = np.array([e.submit_ns for _, e, _ in matched], np.int64)
    e_first_out = np.array([NO_NS if e.first_event_ns is None else e.first_event_ns for _, e, _ in matched], np.int64)
    p_arrival = ns("prefill_arrival_ns")  # a disaggregated request's prefill leg
    leg = np.array(
        [np.nan if e.prefill_leg is None or e.prefill_arrival_ns is None else e.prefill_leg for _, e, _ in matched]
    )
    return pair_parts(
        submit,
        np.full(k, NO_NS, np.int64),  # the tool does not say when it began writing
        first,
        e_submit,
        ns("first_generated_ns"),
        e_first_out,
        ns("server_received_ns"),
        ns("server_first_chunk_ns"),
        p_arrival,
        np.where(leg == leg, p_arrival + np.round(np.nan_to_num(leg) * 1e9).astype(np.int64), NO_NS),
    )


def _f(v) -> float | None:
    v = float(v)
    return None if v != v else v


def add_client_results_options(p) -> None:
    """``--client-results`` and its companions, for compare and report."""
    p.add_argument(
        "--client-results",
        metavar="FILE",
        help="take the client boundary from a load tool's per-request results instead of otel-llm's client "
        "spans, joined to the store's server and engine records by the request id the tool sent "
        "(see --client-results-format)",
    )
    p.add_argument(
        "--client-results-format",
        choices=FORMATS,
        default="vllm-bench",
        help="the tool that wrote --client-results: vllm-bench (vllm bench serve --save-result --save-detailed, "
        "joined by the request id it sent) or guidellm (guidellm run --output kind=json, joined by the response "
        "id the server returned); default vllm-bench",
    )
    p.add_argument(
        "--client-id-prefix",
        metavar="PREFIX",
        help="the tool's request id prefix (vllm bench serve --request-id-prefix); default: found in the store",
    )


def apply_client_results(args, batch: RecordBatch) -> RecordBatch:
    """``batch`` with the client boundary of ``--client-results`` when given (a line on stderr
    says how many of the tool's requests were joined); usage errors as CLIError."""
    if not getattr(args, "client_results", None):
        return batch
    import sys

    from otel_llm.cli_options import CLIError

    try:
        results = read_results(args.client_results, args.client_results_format)
        joined, how, missing = join_client(results, batch, args.client_id_prefix)
    except (OSError, ValueError) as exc:
        raise CLIError(f"--client-results: {exc}") from None
    n = len(results.requests)
    print(
        f"client boundary: {n - missing} of {n} requests of {results.tool} ({args.client_results}) joined by "
        f"{how}" + (f"; {missing} not in the store" if missing else ""),
        file=sys.stderr,
    )
    return joined
