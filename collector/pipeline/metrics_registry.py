"""The derived metrics: what is measured, kept apart from where it is sent.

Cumulative histograms and counters, labelled with ``boundary`` and ``model`` (and ``status`` /
``slo``), fed in vectorised batches (numpy bucket counting, so pooled ITL samples cost no Python
per sample). The Prometheus endpoint and the OTLP metrics push both read :meth:`MetricsRegistry.snapshot`.

Names follow the GenAI semantic conventions with their advisory buckets where one exists; the
rest are under ``llm.``. Latency histograms hold completed requests only (status ok), as
docs/metrics/spec.md's distributions do; ``llm.requests`` counts every status. Goodput over any window
is a PromQL rate of ``llm.slo.good_requests`` (one series per configured SLO), and attainment is
its ratio to ``llm.requests{status="ok"}``. Under sampling (a record's ``sample_weight`` = 1 / the
probability it was kept with) the counters count each request for its weight, so their rates
estimate the unsampled ones; the histograms hold the sampled requests.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from otel_llm.metrics.fluidity import FluidityTarget, miss_rates
from otel_llm.metrics.request_math import RequestMetrics
from otel_llm.metrics.slo import SLO
from otel_llm.metrics.summary import bound_checks, bound_judged, weighted_sum
from otel_llm.semconv import Boundary, RequestStatus

from .invariants import tally
from .records import RecordBatch
from .stalls import DEFAULT_FACTOR, DEFAULT_FLOOR_S, STALL_CLASSES, classify_stalls
from .ttft_parts import COARSE, FINE, TWO_CLOCKS, shown
from .ttft_parts import NAMES as TTFT_PARTS

# GenAI semantic conventions, advisory explicit bucket boundaries (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
FLUIDITY_BUCKETS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99, 1.0)
ACCEPTANCE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


@dataclass
class HistogramSeries:
    counts: np.ndarray  # per bucket, len(bounds) + 1 (last: +Inf)
    sum: float = 0.0
    count: int = 0
    min: float = float("inf")
    max: float = float("-inf")


@dataclass
class Histogram:
    name: str
    unit: str
    description: str
    bounds: tuple[float, ...]
    label_names: tuple[str, ...]
    series: dict[tuple, HistogramSeries] = field(default_factory=dict)

    def observe(self, labels: tuple, values: np.ndarray) -> None:
        nan = np.isnan(values)
        if nan.any():
            values = values[~nan]
        if not len(values):
            return
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = HistogramSeries(np.zeros(len(self.bounds) + 1, np.int64))
        # le buckets: value v goes to the first bound >= v
        if len(values) > 4 * len(self.bounds) * 64:  # many samples (ITL): one vectorised compare per bound
            le = np.fromiter((np.count_nonzero(values <= b) for b in self.bounds), np.int64, len(self.bounds))
            s.counts += np.diff(le, prepend=0, append=len(values))
        else:
            s.counts += np.bincount(np.searchsorted(self.bounds, values, side="left"), minlength=len(self.bounds) + 1)
        s.sum += float(values.sum())
        s.count += len(values)
        s.min = min(s.min, float(values.min()))
        s.max = max(s.max, float(values.max()))


@dataclass
class Counter:
    name: str
    unit: str
    description: str
    label_names: tuple[str, ...]
    series: dict[tuple, float] = field(default_factory=dict)

    def add(self, labels: tuple, n: float) -> None:
        if n:
            self.series[labels] = self.series.get(labels, 0) + n

    def add_from_zero(self, labels: tuple, n: float) -> None:
        """:meth:`add`, the series there (at 0) from its first record on, so that rate() has a base."""
        self.series.setdefault(labels, 0)
        self.add(labels, n)


BM = ("boundary", "model")
#: The model label of the records past the registry's limit of distinct models.
OTHER_MODEL = "_other"
#: Distinct values labelled of a label that engines name (speculative-decoding methods: ngram,
#: draft_model, eagle, ...; KV connectors: NixlConnector, ...); past it, a new one folds into _other
MAX_SPEC_METHODS = MAX_NAMED = 16
#: Longest model label kept (a longer name is cut, so one request cannot make a scrape huge).
MAX_LABEL_CHARS = 128


@dataclass(frozen=True)
class Family:
    """One exported metric family, declared once: the registry's attribute that holds it, its
    OpenTelemetry name, unit and help; ``buckets`` for a histogram (None: a counter); the labels
    after boundary and model; ``when``: the registry's option it needs (None: always there)."""

    attr: str
    name: str
    unit: str
    help: str
    buckets: tuple[float, ...] | None = None
    labels: tuple[str, ...] = ()
    when: str | None = None

    def wanted(self, registry) -> bool:
        """Whether ``registry`` exports this family (its option, if any, is set)."""
        return self.when is None or getattr(registry, self.when) is not None

    def make(self) -> Histogram | Counter:
        if self.buckets is not None:
            return Histogram(self.name, self.unit, self.help, self.buckets, BM + self.labels)
        return Counter(self.name, self.unit, self.help, BM + self.labels)


#: What the collector exports of its derived records, in exposition order. Histograms observe
#: completed requests unless their help says otherwise.
FAMILIES: tuple[Family, ...] = (
    Family(
        "ttft",
        "gen_ai.server.time_to_first_token",
        "s",
        "Time to first token (spec: TTFT), completed requests",
        TTFT_BUCKETS,
    ),
    Family(
        "tpot",
        "gen_ai.server.time_per_output_token",
        "s",
        "Time per output token after the first (spec: TPOT; requests with N > 1)",
        TPOT_BUCKETS,
    ),
    Family(
        "duration",
        "gen_ai.server.request.duration",
        "s",
        "End-to-end request duration (spec: E2E), completed requests",
        DURATION_BUCKETS,
    ),
    # the client boundary again under the GenAI client conventions' names (a streamed call's
    # chunks are its token events): what OpenTelemetry users look for at a client
    Family(
        "client_ttfc",
        "gen_ai.client.operation.time_to_first_chunk",
        "s",
        "Client: time from the call to the first chunk with a token (the client TTFT), completed requests",
        TTFT_BUCKETS,
    ),
    Family(
        "client_tpoc",
        "gen_ai.client.operation.time_per_output_chunk",
        "s",
        "Client: time between chunks after the first (the client ITL), completed requests",
        ITL_BUCKETS,
    ),
    Family(
        "client_duration",
        "gen_ai.client.operation.duration",
        "s",
        "Client: the call's duration (the client E2E), completed requests",
        DURATION_BUCKETS,
    ),
    Family(
        "itl",
        "llm.inter_token_latency",
        "s",
        "Inter-token latency, every gap between token events of completed requests",
        ITL_BUCKETS,
    ),
    Family("itl_max", "llm.inter_token_latency.max", "s", "Largest inter-token gap per completed request", ITL_BUCKETS),
    Family(
        "front_end",
        "llm.frontend.duration",
        "s",
        "Engine front-end time: arrival to queued (rendering, tokenization, the hand-off to the engine core)",
        TTFT_BUCKETS,
    ),
    Family(
        "queue", "llm.queue.duration", "s", "Engine queue time: queued (else arrival) to first scheduled", TTFT_BUCKETS
    ),
    Family(
        "prefill",
        "llm.prefill.duration",
        "s",
        "Engine prefill time: first scheduled to first token generated",
        TTFT_BUCKETS,
    ),
    Family("requests", "llm.requests", "{request}", "Requests derived, by status", labels=("status",)),
    Family(
        "good",
        "llm.slo.good_requests",
        "{request}",
        "Completed requests meeting every bound of the SLO (rate = goodput)",
        labels=("slo",),
    ),
    Family(
        "unjudged",
        "llm.slo.unjudged_requests",
        "{request}",
        "Completed requests a bound of the SLO cannot judge (their source does not tell it: a token count, "
        "per-token times): never good; attainment = good / (completed - unjudged)",
        labels=("slo",),
    ),
    Family("output_tokens", "llm.usage.output_tokens", "{token}", "Output tokens of derived requests, every status"),
    Family("preemptions", "llm.preemptions", "{preemption}", "Preemptions of derived engine requests"),
    Family(
        "unread",
        "llm.tokens.unread",
        "{token}",
        "Engine output tokens of requests whose client gave up before receiving them (work for a reader "
        "who had gone; paired requests, counted at the engine boundary)",
    ),
    Family(
        "after_abort",
        "llm.tokens.after_abort",
        "{token}",
        "Tokens engines generated for requests after those were aborted, and dropped (work wasted; "
        "llm.usage.tokens_after_abort of aborted engine requests)",
    ),
    Family(
        "violations",
        "llm.timeline.violations",
        "{request}",
        "Derived records whose timeline breaks an ordering that must hold (an event before its arrival, a "
        "boundary not inside the one around it), by kind (collector.pipeline.invariants.KINDS); never clamped away",
        labels=("kind",),
    ),
    Family(
        "ttft_part",
        "llm.ttft.part",
        "s",
        f"The client TTFT in its parts ({', '.join(FINE)} with the HTTP server span; {' and '.join(COARSE)} "
        f"where it is missing; paired ok requests; {', '.join(TWO_CLOCKS)} span two clocks, uncorrected for "
        "their offset)",
        TTFT_BUCKETS,
        labels=("part",),
    ),
    Family(
        "stalls",
        "llm.stalls",
        "{stall}",
        "Paired requests whose largest client gap between tokens is over the stall threshold, by cause",
        labels=("cause",),
    ),
    Family(
        "stall_seconds",
        "llm.stall.seconds",
        "s",
        f"Seconds of those largest gaps, by cause ({', '.join(STALL_CLASSES)})",
        labels=("cause",),
    ),
    # speculative decoding: engine records joined with their engine's account
    # (collector/pipeline/speculation.py, docs/metrics/speculative.md); every status
    Family(
        "spec_draft_tokens",
        "llm.spec_decode.draft_tokens",
        "{token}",
        "Speculative decoding: draft tokens the engine verified, by method (vLLM: vllm:spec_decode_num_draft_tokens)",
        labels=("method",),
    ),
    Family(
        "spec_accepted_tokens",
        "llm.spec_decode.accepted_tokens",
        "{token}",
        "Speculative decoding: of those draft tokens, the accepted, by method",
        labels=("method",),
    ),
    Family(
        "spec_acceptance",
        "llm.spec_decode.acceptance_rate",
        "1",
        "Speculative decoding: each request's accepted / draft tokens, requests with drafts, by method",
        ACCEPTANCE_BUCKETS,
        labels=("method",),
    ),
    # disaggregated prefill/decode (docs/metrics/disaggregated.md): the decode engine's KV fetch
    # (collector/pipeline/kv_fetch.py) and the prefill engine's hold, by KV connector; completed requests
    Family(
        "kv_transfer",
        "llm.kv_transfer.duration",
        "s",
        "P/D: the decode engine's KV transfer, its load started -> its scheduler saw it complete (the "
        "kv_transfer part), engine boundary, by connector",
        TTFT_BUCKETS,
        labels=("connector",),
    ),
    Family(
        "kv_blocks",
        "llm.kv_transfer.blocks",
        "{block}",
        "P/D: KV blocks the decode engines' loads asked for, engine boundary, by connector",
        labels=("connector",),
    ),
    Family(
        "kv_bytes",
        "llm.kv_transfer.bytes",
        "By",
        "P/D: bytes the decode engines' loads moved, as the transport says (NIXL's telemetry), engine boundary, "
        "by connector",
        labels=("connector",),
    ),
    Family(
        "kv_share",
        "llm.kv_transfer.ttft_share",
        "1",
        "P/D: each request's KV transfer / its client TTFT, client boundary, by connector",
        ACCEPTANCE_BUCKETS,
        labels=("connector",),
    ),
    Family(
        "kv_hold",
        "llm.kv_hold.duration",
        "s",
        "P/D: how long the prefill engine held the request's KV blocks for the decode engine, its finish -> "
        "the blocks freed, engine boundary, by connector",
        DURATION_BUCKETS,
        labels=("connector",),
    ),
    Family(
        "fluidity_index",
        "llm.fluidity.index",
        "1",
        "Fluidity index of completed requests with a token (1 - missed / total token deadlines; "
        "docs/metrics/fluidity.md), with the deadlines of --fluidity",
        FLUIDITY_BUCKETS,
        when="fluidity",
    ),
    Family(
        "fluid",
        "llm.fluidity.fluid_requests",
        "{request}",
        "Completed requests whose fluidity index reached the --fluidity target",
        when="fluidity",
    ),
)


class MetricsRegistry:
    """Cumulative histograms and counters of derived records, by boundary and model. The model
    label takes at most ``max_models`` distinct values (each at most :data:`MAX_LABEL_CHARS`);
    later models fold into :data:`OTHER_MODEL` and are counted (``records_folded``): the series
    and the scrape stay bounded whatever names the spans carry."""

    def __init__(
        self,
        slos: dict[str, SLO] | None = None,
        max_models: int = 100,
        stall_threshold: float = DEFAULT_FLOOR_S,
        stall_factor: float = DEFAULT_FACTOR,
        fluidity: FluidityTarget | None = None,
    ):
        self.slos = dict(slos or {})
        self.fluidity = fluidity
        self.last_stalled: set[str] = set()
        self.external = None  # a callable giving more families (the traced processes' own cost)
        self.stall_threshold = stall_threshold
        self.stall_factor = stall_factor
        self.max_models = max_models
        self._models: set[str] = set()
        self.records_folded = 0
        self._named: dict[str, set[str]] = {}  # label -> the values seen (at most MAX_NAMED each)
        self.start_time_ns = time.time_ns()
        self._lock = threading.Lock()
        for f in FAMILIES:
            if f.wanted(self):
                setattr(self, f.attr, f.make())

    def _model_label(self, model: str) -> str:
        if model in self._models:
            return model
        model = model[:MAX_LABEL_CHARS]
        if model in self._models or len(self._models) < self.max_models:
            self._models.add(model)
            return model
        self.records_folded += 1
        return OTHER_MODEL

    @property
    def families(self) -> list:
        """Every family this registry exports, in :data:`FAMILIES`' order."""
        return [getattr(self, f.attr) for f in FAMILIES if f.wanted(self)]

    def record(self, batch: RecordBatch, rm: RequestMetrics) -> None:
        """Add a batch of derived records; ``rm`` is their per-request metrics, same order.
        Warm-up requests (``otel-llm bench --warmup``) are left out, as ``analyze`` leaves them."""
        self.last_stalled = set()
        if batch.warmup.any():
            from otel_llm.metrics.request_math import request_metrics

            batch = batch.take(np.flatnonzero(~batch.warmup))
            rm = request_metrics(batch.timelines())
        if not len(batch):
            return
        groups: dict[tuple, list[int]] = {}
        for i, labels in enumerate(zip(batch.boundary, map(self._model_label, batch.model))):
            g = groups.get(labels)
            if g is None:
                groups[labels] = [i]
            else:
                g.append(i)
        status = np.array(batch.status)
        ok = status == RequestStatus.OK
        wt = batch.sample_weight if (batch.sample_weight != 1.0).any() else None  # None: integer counts
        total = lambda values, idx: weighted_sum(values, wt, idx)  # each request counts for its weight
        one = np.ones(len(batch), np.int64)
        checks = {name: bound_checks(rm, slo) for name, slo in self.slos.items()}
        judged = {name: np.logical_and.reduce([*bound_judged(rm, slo).values(), ok]) for name, slo in self.slos.items()}
        index = None
        if self.fluidity is not None:  # per completed request with a token; NaN elsewhere
            index = np.full(len(batch), np.nan)
            has = np.flatnonzero(ok & (rm.events > 0) & ~batch.events_summarised)
            rates = miss_rates(batch.event_start, batch.event_offsets_ns, batch.event_tokens, has, self.fluidity)
            index[has] = 1.0 - rates
        broken = [i for i, v in enumerate(batch.violations) if v]  # rare
        with self._lock:
            labels = [(batch.boundary[i], self._model_label(batch.model[i])) for i in broken]
            for (bm, kind), n in tally([batch.violations[i] for i in broken], labels).items():
                self.violations.add(bm + (kind,), n)
            for labels, idx_list in groups.items():
                idx = np.asarray(idx_list)
                sel = idx[ok[idx]]
                self.ttft.observe(labels, rm.ttft[sel])
                self.tpot.observe(labels, rm.tpot[sel])
                self.duration.observe(labels, rm.e2e[sel])
                self.itl_max.observe(labels, rm.itl_max[sel])
                if len(sel) == len(batch):  # one group, every request ok: all the samples
                    itl = rm.itl
                else:  # the samples of the selected requests
                    mask = np.zeros(len(batch), bool)
                    mask[sel] = True
                    itl = rm.itl[mask[rm.itl_request]]
                self.itl.observe(labels, itl)
                if labels[0] == Boundary.CLIENT:
                    self.client_ttfc.observe(labels, rm.ttft[sel])
                    self.client_tpoc.observe(labels, itl)
                    self.client_duration.observe(labels, rm.e2e[sel])
                if labels[0] == Boundary.ENGINE:
                    self.front_end.observe(labels, batch.front_end[sel])
                    self.queue.observe(labels, batch.queue[sel])
                    self.prefill.observe(labels, batch.prefill[sel])
                    self.preemptions.add(labels, total(np.maximum(batch.preemptions, 0), idx))
                    self.unread.add_from_zero(labels, total(np.maximum(batch.tokens_unread, 0), idx))
                    self.after_abort.add_from_zero(labels, total(np.maximum(batch.tokens_after_abort, 0), idx))
                    self._record_speculation(labels, batch, idx, total)
                if labels[0] != Boundary.SERVER and any(batch.pd_connector):
                    self._record_kv(labels, batch, sel, rm)
                if index is not None:
                    x = index[sel]
                    x = x[np.isfinite(x)]
                    self.fluidity_index.observe(labels, x)
                    self.fluid.add_from_zero(labels, int((x >= self.fluidity.target).sum()))
                for st in np.unique(status[idx]).tolist():
                    self.requests.add(labels + (st,), total(one, idx[status[idx] == st]))
                self.output_tokens.add(labels, total(np.maximum(rm.output_tokens, 0), idx))  # -1: unknown
                for name, per_bound in checks.items():
                    good = ok[idx].copy()
                    for passed in per_bound.values():
                        good &= passed[idx]
                    # a series per SLO and group from the first request on
                    self.good.add_from_zero(labels + (name,), total(one, idx[good]))
                    self.unjudged.add_from_zero(labels + (name,), total(one, idx[ok[idx] & ~judged[name][idx]]))
            self._record_pairs(batch, ok)

    def _record_speculation(self, labels: tuple, batch: RecordBatch, idx: np.ndarray, total) -> None:
        """The drafts and acceptances of the engine records ``idx`` that carry their account."""
        said = idx[batch.draft_tokens[idx] >= 0]
        for m, sel in self._by_named("method", batch.spec_method, said):
            self.spec_draft_tokens.add_from_zero(labels + (m,), total(batch.draft_tokens, sel))
            self.spec_accepted_tokens.add_from_zero(labels + (m,), total(batch.accepted_tokens, sel))
            self.spec_acceptance.observe(labels + (m,), batch.acceptance_rate[sel])

    def _by_named(self, label: str, values: list, idx: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """The records ``idx`` grouped by ``values[i]`` (None: ``unknown``), a bounded label: past
        :data:`MAX_NAMED` distinct values, a new one folds into ``_other``."""
        if not len(idx):
            return []
        seen = self._named.setdefault(label, set())
        names = []
        for i in idx.tolist():
            v = values[i] or "unknown"
            if v not in seen and len(seen) < MAX_NAMED:
                seen.add(v)
            names.append(v if v in seen else OTHER_MODEL)
        return [(v, idx[[x == v for x in names]]) for v in sorted(set(names))]

    def _record_kv(self, labels: tuple, batch: RecordBatch, sel: np.ndarray, rm: RequestMetrics) -> None:
        """The KV transfers and holds of the completed records ``sel`` of a P/D engine, by connector."""
        pd = sel[[batch.pd_connector[i] is not None for i in sel.tolist()]]
        for conn, ix in self._by_named("connector", batch.pd_connector, pd):
            lab = labels + (conn,)
            if labels[0] == Boundary.ENGINE:
                self.kv_transfer.observe(lab, batch.kv_transfer[ix])
                self.kv_hold.observe(lab, batch.prefill_kv_hold[ix])
                self.kv_blocks.add(lab, int(np.maximum(batch.kv_blocks[ix], 0).sum()))
                self.kv_bytes.add(lab, int(np.maximum(batch.kv_bytes[ix], 0).sum()))
            elif labels[0] == Boundary.CLIENT:
                ttft = rm.ttft[ix]
                with np.errstate(divide="ignore", invalid="ignore"):
                    self.kv_share.observe(lab, np.where(ttft > 0, batch.kv_transfer[ix] / ttft, np.nan))

    def _record_pairs(self, batch: RecordBatch, ok: np.ndarray) -> None:
        """The client TTFT parts and the stalls of the requests paired in this batch (both of a
        request's records come from the same trace, so from the same derivation batch)."""
        if batch.pairs is None:
            return
        ci, ei = batch.pairs
        keep = ok[ci]
        ci, ei = ci[keep], ei[keep]
        if not len(ci):
            return
        c, e = batch.take(ci), batch.take(ei)
        causes, gaps = classify_stalls(c, e, self.stall_threshold, self.stall_factor)
        # the traces that stalled, for --forward-traces-policy stall (read right after record())
        self.last_stalled = {t for t, k in zip(c.trace_id, causes) if k in STALL_CLASSES}
        models = [self._model_label(m) for m in c.model]
        groups: dict[str, list[int]] = {}
        for i, m in enumerate(models):
            groups.setdefault(m, []).append(i)
        sel_of = {(Boundary.CLIENT, m): np.asarray(ix) for m, ix in groups.items()}
        labels = [(Boundary.CLIENT, m) for m in models]
        # each request's parts at the finest level known: the merged ones only where the server's are not
        cols = {part: np.asarray(getattr(c, part), dtype=float) for part in TTFT_PARTS}
        show = shown(cols)
        for part in TTFT_PARTS:
            v = np.where(show[part], cols[part], np.nan)
            for lab, ix in sel_of.items():
                x = v[ix]
                x = x[np.isfinite(x)]
                if len(x):
                    self.ttft_part.observe(lab + (part,), x)
        for lab, cause, gap in zip(labels, causes, gaps.tolist()):
            key = lab + (cause,)
            for k in STALL_CLASSES:  # every cause has a series from the first pair on (rate() needs a base)
                self.stalls.series.setdefault(lab + (k,), 0)
                self.stall_seconds.series.setdefault(lab + (k,), 0.0)
            if cause in STALL_CLASSES:
                self.stalls.add(key, 1)
                self.stall_seconds.add(key, gap)

    def snapshot(self) -> list:
        """A consistent copy of every family (for exporters on other threads)."""
        import copy

        with self._lock:
            out = copy.deepcopy(self.families)
        return out + (self.external() if self.external is not None else [])
