"""A decode engine's KV fetches (#43): the engine core's account (engine_hooks.vllm.kv_fetch,
engine_hooks.spans.kv_fetch) on a stand-in scheduler shaped as vLLM 0.32's, and the collector's
join (collector/pipeline/kv_fetch.py), which splits the decode engine's queue into the queue, the
KV transfer and the step that took the request up, summing to what it was. The real engines:
tests/integration/test_pd_disagg.py."""

from __future__ import annotations

import time
from types import SimpleNamespace as NS

import pytest

from collector.pipeline import walked_span as sp
from collector.pipeline.account_kinds import every_kind
from collector.pipeline.derive import derive
from collector.pipeline.walked_span import make_span
from engine_hooks import EngineHooks, TracingPipeline
from engine_hooks.vllm.core import instrument_scheduler_class
from otel_llm import semconv as sc
from otel_llm.otlp.export import FileSpanExporter
from otel_llm.otlp.span_records import read_trace_file
from tests.unit.test_disagg_join import MS, derived, pd_call


def scheduler_class():
    class Scheduler:  # vLLM's: one method moves a request between the stages of its KV fetch
        def __init__(self, connector=True):
            self.connector = NS() if connector else None
            self.vllm_config = NS(speculative_config=None)
            self.kv_cache_manager, self.waiting, self.running = NS(usage=0.1), [], []

        def _set_kv_fetch_stage(self, request, stage):
            return None

        def shutdown(self):
            return None

    return Scheduler


def request(rid: str, blocks=None):
    return NS(request_id=rid, kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": blocks})


def test_each_fetch_is_booked_stage_by_stage(tmp_path):
    path = tmp_path / "spans.jsonl"
    pipeline = TracingPipeline(FileSpanExporter(str(path)), service_name="core", interval_s=60, detail="phases")
    cls = scheduler_class()
    assert instrument_scheduler_class(cls, EngineHooks(pipeline))
    plain = cls(connector=False)
    assert "_set_kv_fetch_stage" not in vars(plain)  # no KV connector: untouched
    s = cls()
    a, b, c = request("a", [1, 2, 3]), request("b", [[4, 5], [6]]), request("c")
    for r in (a, b, c):
        s._set_kv_fetch_stage(r, "waiting_to_start")  # at its arrival, and again at the schedule that looks
        s._set_kv_fetch_stage(r, "waiting_to_start")
    s._set_kv_fetch_stage(request("x"), None)  # scheduled without a fetch: nothing booked
    time.sleep(0.002)
    s._set_kv_fetch_stage(a, "in_progress")
    s._set_kv_fetch_stage(b, "in_progress")
    time.sleep(0.003)
    s._set_kv_fetch_stage(a, "completed_waiting")
    time.sleep(0.001)
    s._set_kv_fetch_stage(a, None)  # scheduled
    s._set_kv_fetch_stage(c, None)  # nothing to load: recomputed, no transfer
    pipeline.shutdown()  # b still in flight: it leaves incomplete
    spans = read_trace_file(path)
    spans = {x.attributes[sc.REQUEST_INTERNAL_ID]: x for x in spans if x.name == sc.SPAN_ENGINE_KV_TRANSFER}
    assert set(spans) == {"a", "b", "c"}
    sa = spans["a"].attributes
    load, seen = sa[sc.KV_LOAD_OFFSET], sa[sc.KV_RECEIVED_OFFSET]
    assert 2 * MS <= load < seen - 3 * MS < spans["a"].end_ns - spans["a"].start_ns - 4 * MS + 1
    assert sa[sc.KV_BLOCKS] == 3 and sc.KV_INCOMPLETE not in sa
    sb = spans["b"].attributes
    assert sb[sc.KV_BLOCKS] == 3 and sb[sc.KV_INCOMPLETE] is True and sc.KV_RECEIVED_OFFSET not in sb
    sc_ = spans["c"].attributes
    assert sc.KV_LOAD_OFFSET not in sc_ and sc.KV_BLOCKS not in sc_


def account(rid: str, start_ms: int, load_ms: int | None, seen_ms: int | None, end_ms: int, **kw):
    return make_span(
        "ee" * 16, f"{abs(hash(rid)) % 2**60:016x}", sc.SPAN_ENGINE_KV_TRANSFER, start=start_ms * MS,
        end=end_ms * MS, internal_id=rid, kv_load_offset=None if load_ms is None else (load_ms - start_ms) * MS,
        kv_received_offset=None if seen_ms is None else (seen_ms - start_ms) * MS, kv_blocks=3, **kw,
    )  # fmt: skip


def test_the_decode_queue_gives_up_the_transfer_and_the_parts_still_sum():
    """pd_call's decode leg: queued at 32 ms, scheduled at 55 ms (its SCHEDULED event); its fetch,
    on the engine core's clock: taken at 32 ms, load from 35 ms, seen complete at 50 ms, left at
    55.2 ms (the stage's own moment, after the event: the queue ends at the event)."""
    _, released, _ = derived([pd_call(0)])
    accounts = every_kind(10)
    span = list(account("cmpl-0-d", 32, 35, 50, 55))
    span[sp.END] += 200_000
    _, said = accounts.split([tuple(span)])
    accounts.add(said)
    batch = accounts.join(derive(released)[0])
    recs = {r.boundary: r for r in batch.records()}
    en, cl = recs["engine"], recs["client"]
    assert en.queue == pytest.approx(0.003) and en.kv_transfer == pytest.approx(0.015)
    assert en.kv_ready == pytest.approx(0.005) and en.kv_blocks == 3
    assert (cl.queue, cl.kv_transfer, cl.kv_ready) == (en.queue, en.kv_transfer, en.kv_ready)
    parts = (cl.to_engine, cl.front_end, cl.queue, cl.kv_transfer, cl.kv_ready, cl.prefill, cl.api_out, cl.network_out)
    assert sum(parts) == pytest.approx(cl.ttft, abs=1e-9)
    assert accounts.counters()["kv_fetch_accounts_joined"] == 1


@pytest.mark.parametrize(
    "bad",
    [
        dict(load_ms=None, seen_ms=None),  # no load started: recomputed; the queue keeps its time
        dict(load_ms=35, seen_ms=None),  # never seen complete
        dict(load_ms=40, seen_ms=36),  # out of order: malformed
        dict(load_ms=35, seen_ms=80),  # beyond the span: malformed
    ],
)
def test_a_fetch_that_says_less_splits_nothing(bad):
    _, released, _ = derived([pd_call(0)])
    accounts = every_kind(10)
    _, said = accounts.split([account("cmpl-0-d", 32, end_ms=55, **bad)])
    accounts.add(said)
    batch = accounts.join(derive(released)[0])
    en = next(r for r in batch.records() if r.boundary == "engine")
    assert en.queue == pytest.approx(0.023) and en.kv_transfer is None and en.kv_ready is None
