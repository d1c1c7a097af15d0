"""The collector pipeline: receivers -> assembly -> derivation -> store and exporters.

:class:`Collector` owns the stages and one worker thread that releases assembled traces
(``expire`` every ``tick_s``), derives their records in one vectorised batch, appends them to the
store and the metrics registry. Receivers call :meth:`Collector.accept`, which passes an
:class:`IntakeGate`: while the durable mode replays its spool, and from the moment :meth:`stop`
(SIGTERM) begins, every request is refused with UNAVAILABLE / 503 (the sender retries), so each
request is either kept or refused, never answered OK and then lost. :meth:`stop` waits for the
requests already admitted, stops the receivers, releases every trace still in flight and flushes
it all to the store.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict

from .config import CollectorConfig, host_port
from .pipeline.account_kinds import every_kind
from .pipeline.assembly import AssemblyFull, ReleasedTrace, TraceAssembler
from .pipeline.derive import derive
from .pipeline.metrics_registry import MetricsRegistry
from .pipeline.steps import StepBatch, split_steps
from .receivers.decode import WalkResult, decode_payload
from .receivers.intake import AcceptResult, Overloaded, ReceiverCounters
from .storage.spool import Spool, SpoolFull
from .storage.store import RequestStore
from .storage.store_writer import StoreWriter

log = logging.getLogger("collector")

#: engine steps waiting for the store, per trace of --max-backlog (their bound, with it)
STEPS_PER_BACKLOG_TRACE = 10
#: what a walked span holds beyond its share of the request's bytes (the tuple, its ids, its ints)
SPAN_OVERHEAD_BYTES = 600


def span_bytes(body_bytes: int, spans: int) -> int:
    """Memory one walked span of a request is counted for: an upper bound. Strings decode to their
    wire size; an int array element takes at least 4 wire bytes (an AnyValue in an ArrayValue)
    and 8 decoded; so twice the request's bytes, shared by its spans, plus the span's own overhead."""
    return 2 * body_bytes // max(spans, 1) + SPAN_OVERHEAD_BYTES


#: how long a stop gives forwarding, counted from its start (the derivation of what was in flight
#: included), and at least how long for the records that derivation made
FORWARD_STOP_S = 5.0
FORWARD_LAST_S = 1.0

#: what one derivation pass takes at most (counted span bytes, see :func:`span_bytes`; traces): its
#: temporaries (every token array of the pass joined, the records, their log records) grow with it,
#: and a pass that fell behind took the next one's backlog whole
CHUNK_BYTES = 16 << 20
CHUNK_TRACES = 2000


def derivation_chunks(released: list, max_bytes: int = CHUNK_BYTES, max_traces: int = CHUNK_TRACES):
    """``released`` in order, in runs of at most ``max_traces`` traces and ``max_bytes`` counted
    bytes (a trace larger than that alone)."""
    chunk: list = []
    size = 0
    for r in released:
        if chunk and (size + r.bytes > max_bytes or len(chunk) >= max_traces):
            yield chunk
            chunk, size = [], 0
        chunk.append(r)
        size += r.bytes
    if chunk:
        yield chunk


class IntakeGate:
    """Admits export requests while open; :meth:`close` refuses new ones (:class:`Overloaded`) and
    waits for those already admitted to finish. Starts open."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._closed_because: str | None = None
        self._inside = 0

    def enter(self) -> None:
        with self._cv:
            if self._closed_because is not None:
                raise Overloaded(self._closed_because)
            self._inside += 1

    def leave(self) -> None:
        with self._cv:
            self._inside -= 1
            if not self._inside:
                self._cv.notify_all()

    def close(self, because: str, timeout_s: float) -> bool:
        """Refuse from now on; True once no admitted request is left (False: timed out)."""
        with self._cv:
            self._closed_because = because
            return self._cv.wait_for(lambda: not self._inside, timeout_s)

    def open(self) -> None:
        with self._cv:
            self._closed_because = None


def _resource_instance_id() -> str | None:
    """service.instance.id from OTEL_RESOURCE_ATTRIBUTES, as the OpenTelemetry SDK reads that
    variable (percent-decoded, the last of repeated keys)."""
    from opentelemetry.sdk.resources import OTELResourceDetector

    value = OTELResourceDetector().detect().attributes.get("service.instance.id")
    return str(value) if value else None


def _default_instance_id() -> str:
    import os
    import socket

    return f"{socket.gethostname()}:{os.getpid()}"


class Collector:
    def __init__(self, config: CollectorConfig | None = None):
        self.config = cfg = config or CollectorConfig()
        self.assembler = TraceAssembler(cfg.assembly)
        self.registry = MetricsRegistry(cfg.slos, cfg.max_models, cfg.stall_threshold_s, cfg.stall_factor, cfg.fluidity)
        self.store = RequestStore(cfg.store) if cfg.store else None
        self.store_writer = (
            StoreWriter(self.store, max_unwritten=cfg.store_buffer_records) if self.store is not None else None
        )
        self.spool = (
            Spool(cfg.spool, cfg.spool_segment_bytes, cfg.spool_max_bytes, cfg.spool_fsync) if cfg.spool else None
        )
        self.receiver_counters = ReceiverCounters()
        self.records_derived = 0
        self.events_rejected = 0  # token events dropped as invalid (see derive._events)
        self._backlog: list[ReleasedTrace] = []
        self._backlog_bytes = 0  # memory the backlog's spans hold (see span_bytes)
        self._steps: list[tuple] = []  # walked step spans waiting for the store
        # engines' accounts (speculation, KV fetches) waiting for their records, as many as traces in assembly
        self.accounts = every_kind(cfg.assembly.max_traces)
        self.steps_received = 0
        self.steps_dropped = 0  # the store fell behind by more than the steps' bound
        self._backlog_lock = threading.Lock()
        self._stop = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._paused = threading.Event()
        self._worker = threading.Thread(target=self._run, name="collector-derive", daemon=True)
        self._process_lock = threading.Lock()
        self._json_slots = threading.BoundedSemaphore(cfg.max_json_decodes)
        self.gate = IntakeGate()
        self._replayer: threading.Thread | None = None
        self.receivers: list = []
        # labelled on /metrics only when given (Prometheus labels each scrape target `instance`
        # itself); always the pushed metrics' and records' service.instance.id
        self.instance_label = cfg.instance_id or _resource_instance_id()
        self.instance_id = self.instance_label or _default_instance_id()
        self.prometheus = self.forwarder = self.pusher = self.records_forwarder = None
        self.policy_forwarder = None
        from .receivers.tracer_cost import TracerCosts, families

        self.tracer_costs = TracerCosts()
        self.registry.external = lambda: families(self.tracer_costs)

    # -- intake (receiver threads) ---------------------------------------------------------------
    def accept(self, body: bytes, *, json_body: bool = False, gzipped: bool = False) -> AcceptResult:
        """Decode, walk and assemble one export request. Raises DecodeError (malformed),
        PayloadTooLarge, or Overloaded (also while the spool is replayed, and once stopping began)."""
        try:
            self.gate.enter()
        except Overloaded:
            self.receiver_counters.payloads_refused_overload += 1
            raise
        try:
            return self._accept(body, json_body, gzipped)
        finally:
            self.gate.leave()

    def _accept(self, body: bytes, json_body: bool, gzipped: bool) -> AcceptResult:
        if len(self._backlog) > self.config.max_backlog:
            self.receiver_counters.payloads_refused_overload += 1
            raise Overloaded(f"derivation is {len(self._backlog)} traces behind")
        if self.store_writer is not None and self.store_writer.error is not None:
            # what is accepted must be kept: nothing new until the store takes writes again
            self.receiver_counters.payloads_refused_overload += 1
            raise Overloaded(f"the store cannot write ({self.store_writer.error})")
        if json_body:  # parsing JSON takes ~50x the body in memory: a few at a time
            if not self._json_slots.acquire(timeout=1.0):
                self.receiver_counters.payloads_refused_overload += 1
                raise Overloaded(f"{self.config.max_json_decodes} OTLP/JSON bodies are being decoded")
            try:
                w = decode_payload(body, json_body=True, gzipped=gzipped, max_bytes=self.config.max_message_bytes)
            finally:
                self._json_slots.release()
        else:
            w = decode_payload(body, gzipped=gzipped, max_bytes=self.config.max_message_bytes)
        return self._accept_walked(w)

    def accept_metrics(self, body: bytes, *, json_body: bool = False, gzipped: bool = False) -> bytes:
        """One OTLP metrics export request: the traced processes' own cost is kept
        (:mod:`collector.receivers.tracer_cost`), the rest acknowledged. Returns the response body."""
        return self.tracer_costs.accept(
            body, json_body=json_body, gzipped=gzipped, max_bytes=self.config.max_message_bytes
        )

    def inflight_bytes(self) -> int:
        """Memory the spans in assembly and in the derivation backlog hold (see :func:`span_bytes`)."""
        return self.assembler.bytes + self._backlog_bytes

    def _accept_walked(self, w: WalkResult) -> AcceptResult:
        spans, steps = split_steps(w.spans)  # engine steps bypass assembly (collector.pipeline.steps)
        spans, accounts = self.accounts.split(spans)  # and so do engines' accounts (collector.pipeline.engine_accounts)
        per_span = span_bytes(len(w.body or b""), w.total)
        held, limit = self.inflight_bytes(), self.config.max_inflight_bytes
        if held and held + per_span * len(spans) > limit:  # an empty collector takes any one request
            self.receiver_counters.payloads_refused_overload += 1
            raise Overloaded(f"spans in flight hold {held >> 20} MiB of --max-inflight-bytes {limit >> 20} MiB")
        try:
            if self.spool is None:
                evicted = self.assembler.add(spans, time.monotonic(), per_span)
            else:  # written ahead, then assembled, under one lock (see collector.storage.spool)
                with self.spool.lock:
                    appended = self.spool.append(w.body)
                    try:
                        evicted = self.assembler.add(spans, time.monotonic(), per_span)
                    except AssemblyFull:  # refused: it must not come back at the next start
                        self.spool.undo(appended)
                        raise
        except AssemblyFull as exc:
            self.receiver_counters.payloads_refused_overload += 1
            raise Overloaded(f"trace assembly is full ({exc})") from None
        except (SpoolFull, OSError) as exc:
            self.receiver_counters.payloads_refused_overload += 1
            raise Overloaded(f"the spool cannot take it ({exc})") from None
        c = self.receiver_counters
        c.requests += 1
        c.spans += w.total
        c.spans_rejected += w.rejected
        if evicted:
            self._to_backlog(evicted)
        if steps:
            self._take_steps(steps)
        if accounts:
            self.accounts.add(accounts)
        if self.policy_forwarder is not None:
            self.policy_forwarder.submit(w.body)
        elif self.forwarder is not None:
            self.forwarder.submit(w.body)
        return AcceptResult(w.rejected, w.first_error)

    def _to_backlog(self, released: list[ReleasedTrace]) -> None:
        with self._backlog_lock:
            self._backlog.extend(released)
            self._backlog_bytes += sum(r.bytes for r in released)

    def _take_steps(self, steps: list[tuple]) -> None:
        """Engine step spans go to the store (in batches, with the next derivation tick); at most
        ``STEPS_PER_BACKLOG_TRACE`` x ``--max-backlog`` wait at once (beyond, dropped and counted)."""
        self.steps_received += len(steps)
        if self.store_writer is None:
            return
        with self._backlog_lock:
            room = STEPS_PER_BACKLOG_TRACE * self.config.max_backlog - len(self._steps)
            if room < len(steps):
                self.steps_dropped += len(steps) - max(room, 0)
                steps = steps[: max(room, 0)]
            self._steps.extend(steps)

    # -- derivation (worker thread) --------------------------------------------------------------
    def process(self, released: list[ReleasedTrace]) -> int:
        with self._backlog_lock:
            released = self._backlog + released
            self._backlog, self._backlog_bytes = [], 0
            steps, self._steps = self._steps, []
        if steps and self.store_writer is not None:
            self.store_writer.put(StepBatch.from_walked(steps))
        return sum(self._derive(chunk) for chunk in derivation_chunks(released))

    def _derive(self, released: list[ReleasedTrace]) -> int:
        """Derive, store, record and forward one chunk of released traces; returns its records."""
        with self._process_lock:
            batch, rm = derive(released)
            self.accounts.join(batch)
            if self.store_writer is not None:
                self.store_writer.put(batch)
            self.registry.record(batch, rm)
            if self.policy_forwarder is not None and len(batch):
                from .exporters.trace_policy import decide

                pf = self.policy_forwarder
                pf.verdicts(decide(batch, rm, self.config.slos, self.registry.last_stalled, pf.policy))
            if self.records_forwarder is not None and len(batch):
                from .exporters.records_logs import records_to_logs

                for body in records_to_logs(batch, self.instance_id):
                    self.records_forwarder.submit(body)
            self.records_derived += len(batch)
            self.events_rejected += int(batch.events_rejected.sum())
        return len(batch)

    def tick(self, now: float | None = None) -> int:
        if self.store_writer is not None:
            self.store_writer.retry()
        n = self.process(self.assembler.expire(time.monotonic() if now is None else now))
        if self.policy_forwarder is not None:
            self.policy_forwarder.expire()
        if self.spool is not None:
            oldest = self.assembler.oldest_first_seen()  # first: see Spool.collect
            idle = not self._backlog and (self.store_writer is None or self.store_writer.idle)
            self.spool.collect(oldest, idle)
        return n

    def replay_spool(self) -> int:
        """Assemble every request the spool holds from before this start (a crash, or a shutdown
        that could not store everything), at the pace trace assembly's bounds allow: a request that
        does not fit (``--when-full refuse``) waits for derivation to release room. Returns how many."""
        n = 0
        for body in self.spool.replay():
            try:
                w = decode_payload(body, max_bytes=max(self.config.max_message_bytes, len(body)))
            except ValueError:
                continue
            spans, steps = split_steps(w.spans)
            spans, accounts = self.accounts.split(spans)
            per_span = span_bytes(len(body), w.total)
            while True:
                try:
                    held = self.inflight_bytes()
                    if held and held + per_span * len(spans) > self.config.max_inflight_bytes:
                        raise AssemblyFull("--max-inflight-bytes")
                    evicted = self.assembler.add(spans, time.monotonic(), per_span)
                    break
                except AssemblyFull:
                    if self._stop.is_set():  # stopping: the rest stays in the spool for the next start
                        return n
                    if not self._worker.is_alive():  # replayed before the worker runs: derive here
                        self.tick()
                    time.sleep(self.config.tick_s)
            if evicted:
                self._to_backlog(evicted)
            if steps:
                self._take_steps(steps)
            if accounts:
                self.accounts.add(accounts)
            n += 1
        if n:
            log.info("collector: replayed %d accepted requests from the spool %s", n, self.config.spool)
        return n

    def _replay_then_open(self) -> None:
        try:
            self.replay_spool()
        except Exception:  # what was not replayed stays in the spool for the next start
            log.exception(
                "collector: replaying the spool %s failed; the rest is kept for the next start", self.config.spool
            )
        if not self._stop.is_set():
            self.gate.open()

    def _run(self) -> None:
        while not self._stop.wait(self.config.tick_s):
            if self._paused.is_set():
                continue
            try:
                self.tick()
            except Exception:
                log.exception("collector: derivation failed; going on")

    def pause(self) -> None:
        """Stop deriving (tests of overload); accept() keeps assembling."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    # -- lifecycle ------------------------------------------------------------------------------
    def self_counters(self) -> dict[str, float]:
        """The collector's own counts since it started (Prometheus counters, ``_total``); its levels
        and bounds are :meth:`self_levels`."""
        out = {f"receiver_{k}": v for k, v in asdict(self.receiver_counters).items()}
        out.update({f"assembly_{k}": v for k, v in asdict(self.assembler.counters).items()})
        out["records_derived"] = self.records_derived
        out["engine_steps_received"] = self.steps_received
        out["engine_steps_dropped"] = self.steps_dropped
        out["token_events_rejected"] = self.events_rejected
        out.update(self.accounts.counters())
        out["metrics_records_folded"] = self.registry.records_folded
        if self.store is not None:
            w = self.store_writer
            out.update(
                store_records=w.stored,
                store_engine_steps=w.steps_stored,
                store_duplicates_ignored=w.duplicates,
                store_failed_batches=w.failed_batches,
                store_records_lost=w.records_lost,
            )
        if self.spool is not None:
            out.update(
                spool_replayed_requests=self.spool.replayed_requests,
                spool_torn_records=self.spool.torn_records,
                spool_segments_deleted=self.spool.segments_deleted,
            )
        if self.records_forwarder is not None:
            f = self.records_forwarder
            out.update(forward_records_sent=f.sent, forward_records_failed=f.failed, forward_records_dropped=f.dropped)
        if self.forwarder is not None:
            f = self.forwarder
            out.update(forward_traces_sent=f.sent, forward_traces_failed=f.failed, forward_traces_dropped=f.dropped)
        if self.policy_forwarder is not None:
            pf = self.policy_forwarder
            out.update(
                forward_policy_traces_forwarded=pf.traces_forwarded,
                forward_policy_traces_dropped=pf.traces_dropped,
                forward_policy_decided_early=pf.decided_early,
                forward_policy_bodies_dropped=pf.bodies_dropped,
            )
        return out

    def self_levels(self) -> dict[str, float]:
        """What the collector holds now, each buffer's level beside its configured bound
        (Prometheus gauges)."""
        cfg = self.config
        out = {
            "assembly_traces_in_flight": len(self.assembler),
            "assembly_traces_limit": cfg.assembly.max_traces,
            **self.accounts.waiting(),
            "derivation_backlog_traces": len(self._backlog),
            "derivation_backlog_limit": cfg.max_backlog,
            "inflight_bytes": self.inflight_bytes(),
            "inflight_limit_bytes": cfg.max_inflight_bytes,
            "receiver_http_connections_limit": cfg.max_connections,
        }
        if self.store is not None:
            out.update(
                store_unwritten_records=self.store_writer.unwritten_records,
                store_unwritten_limit=self.store_writer.max_unwritten,
            )
        if self.spool is not None:
            out.update(
                spool_bytes=self.spool.bytes, spool_limit_bytes=self.spool.max_bytes, spool_segments=self.spool.segments
            )
        if self.records_forwarder is not None:
            out["forward_records_queued_bytes"] = self.records_forwarder.queued_bytes
        if self.forwarder is not None:
            out.update(
                forward_traces_queued_bytes=self.forwarder.queued_bytes,
                forward_traces_queue_limit_bytes=self.forwarder.max_queue_bytes,
            )
        if self.policy_forwarder is not None:
            out["forward_policy_held_bytes"] = self.policy_forwarder.held_bytes
        return out

    def start(self) -> Collector:
        cfg = self.config
        from .receivers.otlp_grpc import GrpcReceiver
        from .receivers.otlp_http import HttpReceiver

        if self.spool is not None and self.spool.to_replay:
            # receivers answer 503 until the spool's requests are assembled (in the background, at
            # the pace the bounds allow: a spool larger than them still starts)
            self.gate.close("replaying the spool of the last run", 0.0)
            self._replayer = threading.Thread(target=self._replay_then_open, name="collector-replay", daemon=True)
        if cfg.forward_traces:
            from .exporters.otlp_forward import OTLPForwarder

            transform = None
            if cfg.forward_max_array_bytes:  # the forwarded copy's long token arrays, summarised
                from functools import partial

                from .exporters.array_summary import summarise

                transform = partial(summarise, max_bytes=cfg.forward_max_array_bytes)
            self.forwarder = OTLPForwarder(
                cfg.forward_traces, max_queue_bytes=cfg.forward_queue_bytes, transform=transform
            ).start()
            if cfg.forward_traces_policy is not None:  # traces held until derivation's verdict
                from .exporters.trace_policy import PolicyForwarder

                hold = cfg.assembly.timeout_s + cfg.assembly.peer_wait_s + 10.0
                self.policy_forwarder = PolicyForwarder(
                    cfg.forward_traces_policy,
                    self.forwarder,
                    cfg.forward_queue_bytes,
                    hold_s=hold,
                    max_queued_bytes=cfg.forward_queue_bytes,
                ).start()
        if cfg.forward_records:
            from .exporters.otlp_forward import OTLPForwarder

            self.records_forwarder = OTLPForwarder(
                cfg.forward_records, max_queue_bytes=cfg.forward_queue_bytes, signal="logs"
            ).start()
        if cfg.otlp_grpc:
            self.receivers.append(
                GrpcReceiver(self, cfg.receiver, self.receiver_counters, *host_port(cfg.otlp_grpc)).start()
            )
        if cfg.otlp_http:
            self.receivers.append(
                HttpReceiver(self, cfg.receiver, self.receiver_counters, *host_port(cfg.otlp_http)).start()
            )
        if cfg.prometheus:
            from .exporters.prometheus import PrometheusEndpoint

            self.prometheus = PrometheusEndpoint(
                *host_port(cfg.prometheus),
                self.registry.snapshot,
                self.self_counters,
                self.self_levels,
                token=cfg.auth_token if cfg.metrics_auth else None,
                instance=self.instance_label,
                tls=(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None,
            ).start()
        if cfg.forward_metrics:
            from opentelemetry.sdk.resources import Resource

            from .exporters.otlp_metrics import MetricsPusher

            self.pusher = MetricsPusher(
                cfg.forward_metrics,
                self.registry.snapshot,
                self.registry.start_time_ns,
                cfg.metrics_interval_s,
                Resource.create({"service.name": "otel-llm-collector", "service.instance.id": self.instance_id}),
            ).start()
        self._worker.start()
        if self._replayer is not None:
            self._replayer.start()
        return self

    def stop(self) -> None:
        """Stop receiving, derive and store everything accepted, stop the exporters: within
        ``shutdown_timeout_s`` (what did not make it is logged and counted as lost). Once: a stop
        while another is under way waits for it, and a stop after one returns at once."""
        with self._stop_lock:
            if not self._stopped:
                self._stop_once()
                self._stopped = True

    def _stop_once(self) -> None:
        began = time.monotonic()
        deadline = began + self.config.shutdown_timeout_s
        left = lambda: max(0.0, deadline - time.monotonic())
        # from here every request is refused (503 / UNAVAILABLE, also on kept-alive connections)
        # and those already admitted finish first: all that was answered OK is in assembly
        if not self.gate.close("the collector is stopping", left()):
            log.error("collector: requests still being taken in at the shutdown timeout")
        for r in self.receivers:
            r.stop()
        self._stop.set()
        if self._replayer is not None:
            self._replayer.join(left())
        if self._worker.is_alive():
            self._worker.join(left())
        final = threading.Thread(target=lambda: self.process(self.assembler.flush()), name="collector-flush")
        final.daemon = True
        final.start()
        final.join(left())
        if final.is_alive():
            log.error(
                "collector: shutdown timeout (%.1f s): derivation of the last traces did not finish",
                self.config.shutdown_timeout_s,
            )
        if self.pusher is not None:
            self.pusher.stop()
        # the forwarders share one deadline, counted from the stop's start (a target that never
        # answers cannot stretch the stop), and have at least FORWARD_LAST_S for the last records
        forwarding_ends = min(max(began + FORWARD_STOP_S, time.monotonic() + FORWARD_LAST_S), deadline)
        until = lambda: max(0.0, forwarding_ends - time.monotonic())
        if self.policy_forwarder is not None:  # what it holds is decided (by the ratio) and handed on
            self.policy_forwarder.stop(until())
        if self.forwarder is not None:
            self.forwarder.stop(until())
        if self.records_forwarder is not None:
            self.records_forwarder.stop(until())
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.store is not None:
            self.store_writer.close(left())
            self.store.close()
        if self.spool is not None:
            everything_stored = not final.is_alive() and (
                self.store_writer is None or not self.store_writer.records_lost
            )
            if everything_stored:  # nothing to replay: the spool is emptied
                self.spool.seal()
                self.spool.collect(None, True)
            self.spool.close()
