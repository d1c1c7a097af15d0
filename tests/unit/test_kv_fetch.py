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

        def _connector_finished(self, request):  # a prefill leg's blocks are kept for the decode side
            params = request.kv_transfer_params or {}
            if params.get("do_remote_decode"):
                return True, {"do_remote_prefill": True, "remote_block_ids": [7, 8], "remote_request_id": "p"}
            return False, None

        def _free_blocks(self, request):
            return None

        def _handle_failed_recving(self, failed_req_ids):  # vLLM's, under kv_load_failure_policy=fail
            return set(failed_req_ids)

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


def test_nixls_telemetry_of_each_handle_is_booked_by_its_request(tmp_path):
    """vLLM's NIXL worker polls its transfer handles by request (_pop_done_transfers) and reads each
    completed one's telemetry: the bytes and the transfer time are booked by request, summed over
    its handles, and leave once it has none left; what the worker returns is unchanged. The class is
    hooked once its module is imported, in whichever process imports it."""
    import sys
    import threading
    import types
    from concurrent.futures import Future

    from engine_hooks.vllm import kv_fetch

    class Telemetry:
        def __init__(self, nbytes, xfer_us):
            self.totalBytes, self.xferDuration, self.postDuration, self.descCount = nbytes, xfer_us, 5, 1

    class Agent:
        def __init__(self):
            self.done: dict = {}

        def get_xfer_telemetry(self, handle):
            return self.done[handle]

    class Worker:  # vLLM 0.32's NixlBaseConnectorWorker, as far as this goes
        def __init__(self):
            self.nixl_wrapper = Agent()
            self._handshake_futures: dict = {}

        def _background_nixl_handshake(self, req_id, remote_engine_id, meta):
            fut = self._handshake_futures.setdefault(remote_engine_id, Future())
            fut.add_done_callback(lambda f: self._handshake_futures.pop(remote_engine_id, None))

        def _pop_done_transfers(self, transfers):
            done = set()
            for rid, handles in list(transfers.items()):
                for h in handles:
                    if h in self.nixl_wrapper.done:
                        self.nixl_wrapper.get_xfer_telemetry(h)
                left = [h for h in handles if h not in self.nixl_wrapper.done]
                if not left:
                    done.add(rid)
                    del transfers[rid]
                else:
                    transfers[rid] = left
            return done, set()

    path = tmp_path / "spans.jsonl"
    pipeline = TracingPipeline(FileSpanExporter(str(path)), service_name="core", interval_s=60, detail="phases")
    hooks = EngineHooks(pipeline)
    name = "otel_llm_test_nixl_worker"
    kv_fetch.NIXL_WORKER_MODULE, before = name, kv_fetch.NIXL_WORKER_MODULE
    try:
        kv_fetch.instrument_nixl_worker(lambda: hooks)
        assert not kv_fetch.hooked(Worker._pop_done_transfers)  # not imported: not touched
        module = types.ModuleType(name)
        module.NixlBaseConnectorWorker = Worker
        sys.modules[name] = module  # as if imported before: hooked at once
        kv_fetch.instrument_nixl_worker(lambda: hooks)
    finally:
        kv_fetch.NIXL_WORKER_MODULE = before
        sys.modules.pop(name, None)
    assert kv_fetch.hooked(Worker._pop_done_transfers)
    w = Worker()
    w._background_nixl_handshake("a", "engine-P", None)  # a new peer: a waits for the handshake
    fut = w._handshake_futures["engine-P"]
    t = threading.Thread(target=lambda: (time.sleep(0.005), fut.set_result(None)))  # the handshake's thread
    t.start()
    t.join()
    w._background_nixl_handshake("c", "engine-P", None)  # the peer known by now: no wait
    h1, h2, h3 = object(), object(), object()
    transfers = {"a": [h1, h2], "b": [h3]}
    assert w._pop_done_transfers(transfers) == (set(), set())  # nothing done yet
    w.nixl_wrapper.done[h1] = Telemetry(4096, 700)
    assert w._pop_done_transfers(transfers) == (set(), set()) and transfers == {"a": [h2], "b": [h3]}
    w.nixl_wrapper.done.update({h2: Telemetry(4096, 300), h3: Telemetry(2048, 250)})
    assert w._pop_done_transfers(transfers) == ({"a", "b"}, set()) and transfers == {}
    assert w._pop_done_transfers({}) == (set(), set())
    pipeline.shutdown()
    spans = {x.attributes[sc.REQUEST_INTERNAL_ID]: x for x in read_trace_file(path)}
    assert {x.name for x in spans.values()} == {sc.SPAN_ENGINE_KV_TRANSPORT}
    assert (spans["a"].attributes[sc.KV_BYTES], spans["a"].attributes[sc.KV_WIRE]) == (8192, 1_000_000)
    assert (spans["b"].attributes[sc.KV_BYTES], spans["b"].attributes[sc.KV_WIRE]) == (2048, 250_000)
    assert spans["a"].attributes[sc.KV_HANDSHAKE] >= 5 * MS  # ended on the handshake's thread
    assert sc.KV_HANDSHAKE not in spans["b"].attributes
    assert spans["a"].end_ns - spans["a"].start_ns >= spans["a"].attributes[sc.KV_HANDSHAKE]


def test_a_module_imported_later_is_hooked_as_it_loads(tmp_path):
    """after_import: the hook runs once the module's own code has run, without importing it first."""
    from engine_hooks.after_import import after_import

    (tmp_path / "late_module_for_hooks.py").write_text("class NixlBaseConnectorWorker:\n    pass\n")
    seen = []
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        after_import("late_module_for_hooks", lambda m: seen.append(m.NixlBaseConnectorWorker.__name__))
        assert seen == []
        import late_module_for_hooks  # noqa: F401

        assert seen == ["NixlBaseConnectorWorker"]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("late_module_for_hooks", None)


def test_a_prefill_engine_books_how_long_it_held_the_blocks(tmp_path):
    """The finish -> the blocks freed, for a request whose connector kept its blocks; any other
    request's blocks freed are not an account; a hold still open at shutdown leaves incomplete."""
    path = tmp_path / "spans.jsonl"
    pipeline = TracingPipeline(FileSpanExporter(str(path)), service_name="core", interval_s=60, detail="phases")
    cls = scheduler_class()
    assert instrument_scheduler_class(cls, EngineHooks(pipeline))
    s = cls()
    held = NS(request_id="h", kv_transfer_params={"do_remote_decode": True})
    still = NS(request_id="s", kv_transfer_params={"do_remote_decode": True})
    whole = NS(request_id="w", kv_transfer_params=None)
    assert s._connector_finished(held)[0] is True  # what vLLM's scheduler gets is unchanged
    s._connector_finished(still)
    assert s._connector_finished(whole) == (False, None)
    s._free_blocks(whole)  # freed at once: no hold
    time.sleep(0.004)
    s._free_blocks(held)  # the decode side read them
    pipeline.shutdown()
    spans = {x.attributes[sc.REQUEST_INTERNAL_ID]: x for x in read_trace_file(path) if x.name == sc.SPAN_ENGINE_KV_HOLD}
    assert set(spans) == {"h", "s"}
    h = spans["h"]
    assert h.end_ns - h.start_ns >= 4 * MS and h.attributes[sc.KV_BLOCKS] == 2 and sc.KV_INCOMPLETE not in h.attributes
    assert spans["s"].attributes[sc.KV_INCOMPLETE] is True


def hold(rid: str, start_ms: int, end_ms: int, **kw):
    return make_span(
        "ef" * 16, f"{abs(hash(rid)) % 2**60:016x}", sc.SPAN_ENGINE_KV_HOLD, start=start_ms * MS, end=end_ms * MS,
        internal_id=rid, kv_blocks=2, **kw,
    )  # fmt: skip


def test_the_prefill_legs_hold_joins_the_request_it_served():
    """pd_call: the prefill leg (internal id cmpl-0-p) finished at 19 ms; its blocks freed at 36 ms
    (the decode engine read them). A hold named by no leg joins nothing; one incomplete says nothing."""
    _, released, _ = derived([pd_call(0)])
    accounts = every_kind(10)
    _, said = accounts.split([hold("cmpl-0-p", 19, 36), hold("cmpl-9-p", 19, 40)])
    accounts.add(said)
    import numpy as np

    batch = derive(released)[0]
    batch = accounts.join(batch.take(np.arange(len(batch))[::-1]))  # the client's record first: it names the leg too
    recs = {r.boundary: r for r in batch.records()}
    assert recs["engine"].prefill_kv_hold == pytest.approx(0.017) == recs["client"].prefill_kv_hold
    assert accounts.counters()["kv_hold_accounts_joined"] == 1 and accounts.waiting()["kv_hold_accounts_waiting"] == 1
    # a prefill leg alone (its decode server down): its own hold, by its own id
    _, released, _ = derived([pd_call(1, decode=False)], peer_wait_s=1.0)
    _, said = accounts.split([hold("cmpl-1-p", 19, 5019), hold("cmpl-2-p", 19, 30, kv_incomplete=True)])
    accounts.add(said)
    (alone,) = [r for r in accounts.join(derive(released)[0]).records() if r.boundary == "engine"]
    assert alone.pd_role == "prefill" and alone.prefill_kv_hold == pytest.approx(5.0)


def account(rid: str, start_ms: int, load_ms: int | None, seen_ms: int | None, end_ms: int, **kw):
    return make_span(
        "ee" * 16, f"{abs(hash(rid)) % 2**60:016x}", sc.SPAN_ENGINE_KV_TRANSFER, start=start_ms * MS,
        end=end_ms * MS, internal_id=rid, kv_load_offset=None if load_ms is None else (load_ms - start_ms) * MS,
        kv_received_offset=None if seen_ms is None else (seen_ms - start_ms) * MS, kv_blocks=3, **kw,
    )  # fmt: skip


def transport(rid: str, end_ms: int, nbytes: int = 3 * 65536, wire_ms: int = 4, **kw):
    return make_span(
        "ed" * 16, f"{abs(hash(rid + 't')) % 2**60:016x}", sc.SPAN_ENGINE_KV_TRANSPORT,
        start=(end_ms - wire_ms - 2) * MS, end=end_ms * MS, internal_id=rid, kv_bytes=nbytes,
        **{"kv_wire": wire_ms * MS, "kv_handshake": 2 * MS, **kw},
    )  # fmt: skip


def test_the_decode_queue_gives_up_the_transfer_and_the_parts_still_sum():
    """pd_call's decode leg: queued at 32 ms, scheduled at 55 ms (its SCHEDULED event); its fetch,
    on the engine core's clock: taken at 32 ms, load from 35 ms, seen complete at 50 ms, left at
    55.2 ms (the stage's own moment, after the event: the queue ends at the event)."""
    _, released, _ = derived([pd_call(0)])
    accounts = every_kind(10)
    span = list(account("cmpl-0-d", 32, 35, 50, 55))
    span[sp.END] += 200_000
    _, said = accounts.split([tuple(span), transport("cmpl-0-d", 49)])
    accounts.add(said)
    batch = accounts.join(derive(released)[0])
    recs = {r.boundary: r for r in batch.records()}
    en, cl = recs["engine"], recs["client"]
    assert en.queue == pytest.approx(0.003) and en.kv_transfer == pytest.approx(0.015)
    assert en.kv_ready == pytest.approx(0.005) and en.kv_blocks == 3
    assert en.kv_bytes == cl.kv_bytes == 3 * 65536 and en.kv_wire == cl.kv_wire == pytest.approx(0.004)
    assert en.kv_handshake == cl.kv_handshake == pytest.approx(0.002)
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


def test_the_metrics_say_the_transfer_and_the_hold_by_connector():
    """llm.kv_transfer.* and llm.kv_hold.duration: the decode engine's transfer and blocks and the
    prefill engine's hold at the engine boundary, the transfer's share of the client's TTFT at the
    client's; a request not P/D adds no series."""
    from collector.pipeline.metrics_registry import MetricsRegistry

    _, released, _ = derived([pd_call(0), pd_call(1, 500)])
    accounts = every_kind(10)
    spans = [account("cmpl-0-d", 32, 35, 50, 55), account("cmpl-1-d", 532, 535, 550, 555)]
    spans += [
        hold("cmpl-0-p", 19, 36),
        hold("cmpl-1-p", 519, 540),
        transport("cmpl-0-d", 49),
        transport("cmpl-1-d", 549),
    ]
    _, said = accounts.split(spans)
    accounts.add(said)
    batch, rm = derive(released)
    accounts.join(batch)
    reg = MetricsRegistry()
    reg.record(batch, rm)
    model = {r.boundary: r.model for r in batch.records()}
    eng, cli = ("engine", model["engine"], "NixlConnector"), ("client", model["client"], "NixlConnector")
    t = reg.kv_transfer.series[eng]
    assert t.count == 2 and t.sum == pytest.approx(0.030)
    assert reg.kv_blocks.series[eng] == 6 and reg.kv_bytes.series[eng] == 6 * 65536
    assert reg.kv_hold.series[eng].sum == pytest.approx(0.017 + 0.021)
    assert reg.kv_share.series[cli].sum == pytest.approx(2 * 0.015 / 0.062)
    assert set(reg.kv_transfer.series) == {eng} and set(reg.kv_share.series) == {cli}


@pytest.mark.parametrize(
    "bad",
    [
        dict(nbytes=None),  # bytes not said
        dict(nbytes=-1),
        dict(kv_incomplete=True),  # a transfer still open at shutdown: not what moved
        dict(kv_wire=80 * MS),  # longer than the account itself
    ],
)
def test_a_transport_account_that_says_less_fills_nothing(bad):
    _, released, _ = derived([pd_call(0)])
    accounts = every_kind(10)
    _, said = accounts.split([transport("cmpl-0-d", **{"end_ms": 49, **bad})])
    accounts.add(said)
    en = next(r for r in accounts.join(derive(released)[0]).records() if r.boundary == "engine")
    assert en.kv_bytes is None and en.kv_wire is None
    assert accounts.counters()["kv_transport_accounts_malformed"] == 1


def test_the_perfetto_export_draws_both_engines_and_the_transfer_between_them():
    """pd_call on one clock: the prefill engine's leg 3 -> 19 ms, the decode engine queued at 32 ms,
    its load 35 -> 50 ms, scheduled at 55 ms. Each on the request's track, one after the other,
    the decode queue ending where its load starts."""
    from collector.analysis.perfetto import trace_events

    _, released, _ = derived([pd_call(0)])
    accounts = every_kind(10)
    _, said = accounts.split([account("cmpl-0-d", 32, 35, 50, 55)])
    accounts.add(said)
    batch = accounts.join(derive(released)[0])
    ev = [e for e in trace_events(batch, None)["traceEvents"] if e.get("ph") == "X"]
    at = {e["name"]: (e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in ev}  # ms after the client's call
    assert at["prefill engine's leg"] == pytest.approx((3, 19))
    assert at["queue"] == pytest.approx((32, 35)) and at["KV transfer"] == pytest.approx((35, 50))
    assert at["KV ready"] == pytest.approx((50, 55)) and at["prefill"] == pytest.approx((55, 60))
    assert {e["cat"] for e in ev if e["name"] == "prefill engine's leg"} == {"prefill engine"}


def test_a_load_the_connector_says_failed_is_said_and_splits_nothing(tmp_path):
    """The scheduler hears of a failed load (a handshake or a transfer that failed) at a step: the
    fetch says when; the collector's record says kv_load failed and the queue keeps its time (no
    transfer is shown for a load that did not happen). vLLM's own answer is unchanged."""
    path = tmp_path / "spans.jsonl"
    pipeline = TracingPipeline(FileSpanExporter(str(path)), service_name="core", interval_s=60, detail="phases")
    cls = scheduler_class()
    assert instrument_scheduler_class(cls, EngineHooks(pipeline))
    s = cls()
    bad, good = request("bad", [1]), request("good", [2])
    for r in (bad, good):
        s._set_kv_fetch_stage(r, "waiting_to_start")
        s._set_kv_fetch_stage(r, "in_progress")
    time.sleep(0.002)
    assert s._handle_failed_recving({"bad", "unknown"}) == {"bad", "unknown"}
    s._set_kv_fetch_stage(good, "completed_waiting")
    for r in (bad, good):
        s._set_kv_fetch_stage(r, None)
    pipeline.shutdown()
    spans = {x.attributes[sc.REQUEST_INTERNAL_ID]: x.attributes for x in read_trace_file(path)}
    assert spans["bad"][sc.KV_FAILED_OFFSET] >= 2 * MS and sc.KV_FAILED_OFFSET not in spans["good"]

    _, released, _ = derived([pd_call(0)])
    accounts = every_kind(10)
    _, said = accounts.split([account("cmpl-0-d", 32, 35, 50, 55, kv_failed_offset=10 * MS)])
    accounts.add(said)
    recs = {r.boundary: r for r in accounts.join(derive(released)[0]).records()}
    en, cl = recs["engine"], recs["client"]
    assert en.kv_load == cl.kv_load == "failed"
    assert en.queue == pytest.approx(0.023) and en.kv_transfer is None  # the queue keeps its time


@pytest.mark.parametrize(
    "said, load",
    [
        (dict(load_ms=35, seen_ms=50), "loaded"),
        (dict(load_ms=None, seen_ms=None), "none"),  # nothing to load: the prompt recomputed
        (dict(load_ms=35, seen_ms=None, kv_incomplete=True), None),  # cut short: not known
    ],
)
def test_the_record_says_what_became_of_the_load(said, load):
    _, released, _ = derived([pd_call(0)])
    accounts = every_kind(10)
    _, spans = accounts.split([account("cmpl-0-d", 32, end_ms=55, **said)])
    accounts.add(spans)
    en = next(r for r in accounts.join(derive(released)[0]).records() if r.boundary == "engine")
    assert en.kv_load == load
