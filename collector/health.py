"""The collector's own series, declared once: each counter and level it exposes about itself, with
what it counts.

:meth:`collector.service.Collector.self_counters` and ``self_levels`` give the values by these keys
(a component that is off gives none of its keys); the Prometheus exposition names them
``otel_llm_collector_<key>`` (``_total`` on a counter) and takes its help from here; the Grafana
dashboard names them from here too. ``tests/unit/test_collector.py`` holds the service against this
table, every component on. Plain data, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Series:
    key: str
    help: str
    level: bool = False  # a level or a configured bound (a gauge), else a count since start (a counter)


COUNTS: tuple[Series, ...] = (
    # receivers (collector.receivers.intake.ReceiverCounters)
    Series("receiver_requests", "OTLP export requests received (gRPC and HTTP)"),
    Series("receiver_spans", "spans in the requests accepted"),
    Series("receiver_spans_rejected", "spans left out of accepted requests as invalid"),
    Series("receiver_payloads_invalid", "requests refused as malformed (INVALID_ARGUMENT / 400)"),
    Series("receiver_payloads_refused_overload", "requests refused with a retryable error (UNAVAILABLE / 503)"),
    Series("receiver_unauthenticated", "requests refused for a missing or wrong bearer token"),
    Series("receiver_connections_refused", "OTLP/HTTP connections over --max-connections (answered 503)"),
    Series("receiver_requests_timed_out", "OTLP/HTTP requests not arrived whole within --request-timeout (closed)"),
    Series("receiver_tls_handshakes_failed", "TLS handshakes that failed or timed out (OTLP/HTTP)"),
    # assembly (collector.pipeline.assembly.AssemblyCounters)
    Series("assembly_spans_received", "spans taken into trace assembly"),
    Series("assembly_spans_duplicate", "spans received twice (the same span id in a trace), kept once"),
    Series("assembly_spans_late", "spans dropped because their request (or its phase's) was derived already"),
    Series("assembly_spans_late_derived", "late spans for a boundary not derived yet, derived on their own"),
    Series(
        "assembly_spans_held_back",
        "spans kept past a trace's timeout release: an engine request still waiting for its client's span",
    ),
    Series(
        "assembly_spans_paired_by_id",
        "GenAI client spans whose trace context did not reach the server, joined to their engine's trace by "
        "gen_ai.response.id",
    ),
    Series("assembly_spans_over_trace_limit", "spans dropped because their trace had --max-spans-per-trace"),
    Series("assembly_requests_refused_full", "export requests refused for want of room (--on-full refuse)"),
    Series("assembly_traces_released", "traces released to derivation"),
    Series("assembly_traces_released_grace", "traces released when their request spans had ended and the grace passed"),
    Series("assembly_traces_released_timeout", "traces released at the assembly timeout, incomplete"),
    Series("assembly_traces_evicted", "traces released early to make room under --max-traces"),
    # derivation
    Series("records_derived", "records derived (one per request and boundary)"),
    Series("engine_steps_received", "engine step records received"),
    Series("engine_steps_dropped", "engine step records dropped (over the steps' bound)"),
    Series("token_events_rejected", "token events dropped as invalid (outside their span, a count out of range)"),
    Series("metrics_records_folded", "records counted under the model label _other (past --max-models)"),
    # speculative decoding accounts (collector.pipeline.speculation)
    Series("speculation_accounts_received", "engines' speculative-decoding accounts received (llm.engine.speculation)"),
    Series("speculation_accounts_joined", "accounts joined to their engine records"),
    Series("speculation_accounts_evicted", "accounts dropped unjoined to stay within --max-traces"),
    Series("speculation_accounts_malformed", "accounts left out: no internal id, or arrays that do not line up"),
    # a decode engine's KV fetch accounts (collector.pipeline.kv_fetch)
    Series("kv_fetch_accounts_received", "decode engines' KV fetch accounts received (llm.engine.kv_transfer)"),
    Series("kv_fetch_accounts_joined", "KV fetch accounts joined to their engine records"),
    Series("kv_fetch_accounts_evicted", "KV fetch accounts dropped unjoined to stay within --max-traces"),
    Series("kv_fetch_accounts_malformed", "KV fetch accounts left out: no internal id, or times out of order"),
    # a prefill engine's KV hold accounts (collector.pipeline.kv_fetch)
    Series("kv_hold_accounts_received", "prefill engines' KV hold accounts received (llm.engine.kv_hold)"),
    Series("kv_hold_accounts_joined", "KV hold accounts joined to the records of their prefill legs"),
    Series("kv_hold_accounts_evicted", "KV hold accounts dropped unjoined to stay within --max-traces"),
    Series("kv_hold_accounts_malformed", "KV hold accounts left out: no internal id, or times out of order"),
    # a P/D engine's connector worker's transfer accounts (collector.pipeline.kv_fetch)
    Series("kv_transport_accounts_received", "connector workers' transfer accounts received (llm.engine.kv_transport)"),
    Series("kv_transport_accounts_joined", "transfer accounts joined to their engine records"),
    Series("kv_transport_accounts_evicted", "transfer accounts dropped unjoined to stay within --max-traces"),
    Series(
        "kv_transport_accounts_malformed",
        "transfer accounts left out: no internal id, bytes or time not said, incomplete, times out of order",
    ),
    # store (--store)
    Series("store_records", "records written to the store"),
    Series("store_engine_steps", "engine steps written to the store"),
    Series("store_duplicates_ignored", "records the store had already (a replay), not written twice"),
    Series("store_failed_batches", "batches the store refused (kept and written again)"),
    Series("store_records_lost", "records that could not be written before shutdown and are lost"),
    # spool (--spool)
    Series("spool_replayed_requests", "export requests replayed from the spool at start"),
    Series("spool_torn_records", "torn records at a spool segment's end, skipped (a write cut by a crash)"),
    Series("spool_segments_deleted", "spool segments deleted once their traces were stored"),
    # forwarding
    Series("forward_records_sent", "records sent as OTLP logs (--forward-records)"),
    Series("forward_records_failed", "records whose OTLP logs export failed"),
    Series("forward_records_dropped", "records dropped from a full forwarding queue"),
    Series("forward_traces_sent", "traces forwarded (--forward-traces)"),
    Series("forward_traces_failed", "traces whose forwarding failed"),
    Series("forward_traces_dropped", "traces dropped from a full forwarding queue"),
    Series("forward_policy_traces_forwarded", "traces the forwarding policy kept and forwarded"),
    Series("forward_policy_traces_dropped", "traces the forwarding policy left out"),
    Series("forward_policy_decided_early", "traces the policy decided before their records were derived"),
    Series("forward_policy_bodies_dropped", "held bodies dropped at the policy's byte bound"),
)

LEVELS: tuple[Series, ...] = (
    Series("assembly_traces_in_flight", "traces being assembled now", True),
    Series("assembly_traces_limit", "--max-traces", True),
    Series("speculation_accounts_waiting", "accounts waiting for their records (at most --max-traces)", True),
    Series("kv_fetch_accounts_waiting", "KV fetch accounts waiting for their records (at most --max-traces)", True),
    Series("kv_hold_accounts_waiting", "KV hold accounts waiting for their records (at most --max-traces)", True),
    Series("kv_transport_accounts_waiting", "transfer accounts waiting for their records (at most --max-traces)", True),
    Series("derivation_backlog_traces", "released traces waiting for derivation", True),
    Series("derivation_backlog_limit", "--max-backlog", True),
    Series("inflight_bytes", "bytes of export requests held in memory now", True),
    Series("inflight_limit_bytes", "--max-inflight-bytes", True),
    Series("receiver_http_connections_limit", "--max-connections", True),
    Series("store_unwritten_records", "records derived, not yet written to the store", True),
    Series("store_unwritten_limit", "the most records held unwritten before new data is refused", True),
    Series("spool_bytes", "bytes in the spool now", True),
    Series("spool_limit_bytes", "the spool's byte bound", True),
    Series("spool_segments", "spool segments on disk now", True),
    Series("forward_records_queued_bytes", "bytes of records waiting to be forwarded", True),
    Series("forward_traces_queued_bytes", "bytes of traces waiting to be forwarded", True),
    Series("forward_traces_queue_limit_bytes", "the trace forwarding queue's byte bound", True),
    Series("forward_policy_held_bytes", "bytes the forwarding policy holds until it decides", True),
)

BY_KEY: dict[str, Series] = {s.key: s for s in COUNTS + LEVELS}


def series_name(key: str, level: bool) -> str:
    """The exposed name: ``otel_llm_collector_<key>``, with ``_total`` on a count."""
    return "otel_llm_collector_" + key + ("" if level else "_total")


def exposed_name(key: str) -> str:
    """:func:`series_name` of a declared series (KeyError for a key this table does not declare)."""
    return series_name(key, BY_KEY[key].level)


def help_of(key: str, level: bool) -> str:
    """The declared help, else (a key added without its entry: a test fails on it) a plain one."""
    s = BY_KEY.get(key)
    return (
        f"the collector's {s.help}"
        if s
        else f"the collector's own {key.replace('_', ' ')} ({'a level' if level else 'a count'})"
    )
