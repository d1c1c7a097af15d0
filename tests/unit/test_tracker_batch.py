"""A whole step's tokens at once (RequestTracker.emitted, what vLLM's and transformers' adapters
use) give the same requests as the per-request hooks (generated, then token_out), and the spans
built from them are the same whichever exporter takes them."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine_hooks import TracingPipeline
from engine_hooks.hot_path.hook_events import ARRIVAL, FINISH, RAW
from engine_hooks.spans.span_factory import SpanFactory
from engine_hooks.spans.tracker import RequestTracker
from otel_llm import semconv as sc
from otel_llm.clock import monotonic_ns
from otel_llm.otlp import otlp_encode
from otel_llm.otlp.export import FileSpanExporter, takes_int_arrays
from otel_llm.otlp.tracing import make_resource

# a run: arrivals, steps (which requests got how many tokens) and finishes, in one order
ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(0, 5)),
        st.tuples(st.just("finish"), st.integers(0, 5)),
        st.tuples(
            st.just("step"),
            st.lists(
                st.tuples(st.integers(0, 7), st.sampled_from([-3, 0, 1, 1, 1, 2, 5, 4095, 2**20 - 1, 2**20, 2**40])),
                max_size=6,
            ),
        ),
        st.tuples(st.just("preempt"), st.integers(0, 5)),
        # the last step's requests again, one token each, for n steps: steady decoding (a run)
        st.tuples(st.just("again"), st.integers(1, 6)),
    ),
    max_size=60,
)


def _fields(r):
    return (
        r.request_id,
        r.status,
        r.first_generated_ns,
        r.last_generated_ns,
        r.generated_tokens,
        r.output_tokens,
        [int(x) for x in r.out_times_ns],
        [int(x) for x in r.out_tokens],
        [int(x) for x in r.gen_times_ns],
        [int(x) for x in r.gen_tokens],
        r.preemption_tokens,
        r.incomplete,
    )


def _steady(run):
    """``run`` with each ``again`` written out as its steps."""
    last = []
    for op, arg in run:
        if op == "again":
            for _ in range(arg):
                yield "step", [(i, 1) for i, _ in last]
        else:
            if op == "step":
                last = arg
            yield op, arg


def _play(run, batched: bool, trim_at: int | None = None, in_order: bool = True):
    tr = RequestTracker()
    if not in_order:  # every request through the general (numpy) unpacking
        tr._unpack_in_order = lambda st: False
    if trim_at is not None:
        tr._trim_at = trim_at  # trim the step arrays often: what requests refer to must survive it
    t = 1_000_000
    for op, arg in _steady(run):
        t += 1000
        if op == "arrive":
            tr.arrival(f"r{arg}", t, input_tokens=3)
        elif op == "finish":
            tr.finish(f"r{arg}", t, "ok", "stop")
        elif op == "preempt":
            tr.preempted(f"r{arg}", t)
            tr.scheduled(f"r{arg}", t + 1)
        else:
            rids = [f"r{i}" for i, _ in arg]
            counts = [n for _, n in arg]
            if batched:
                tr.emitted(rids, counts, t, t + 7)
            else:
                for rid, n in zip(rids, counts):
                    if n:
                        tr.generated(rid, t, n)
                        tr.token_out(rid, t + 7, n)
    tr.close_all(t + 10**6)
    return tr


@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from([None, 1, 3]))
def test_a_step_at_once_is_the_same_as_each_request_in_turn(run, trim_at):
    one_by_one = _play(run, batched=False)
    at_once = _play(run, batched=True, trim_at=trim_at)
    a, _ = one_by_one.take()
    b, _ = at_once.take()
    assert [_fields(r) for r in b] == [_fields(r) for r in a]
    # the in-order unpacking (array slices) and the general one (numpy) give the same requests
    c, _ = _play(run, batched=True, trim_at=trim_at, in_order=False).take()
    assert [_fields(r) for r in c] == [_fields(r) for r in b]
    # an output for a request not in flight is counted: once per output here, where the
    # per-request hooks count each of their two calls (and are only called with tokens)
    live, stray, stray_with_tokens = set(), 0, 0
    for op, arg in _steady(run):
        if op == "arrive":
            live.add(arg)
        elif op == "finish":
            live.discard(arg)
        elif op == "step":
            missing = [n for i, n in arg if i not in live]
            stray += len(missing)
            stray_with_tokens += sum(1 for n in missing if n)
    assert at_once.unknown_events - stray == one_by_one.unknown_events - 2 * stray_with_tokens


@pytest.mark.parametrize(
    "run",
    [
        # steady decoding, one request finishing in the middle and the others going on
        [("arrive", 0), ("arrive", 1), ("step", [(0, 1), (1, 1)]), ("again", 5), ("finish", 1), ("again", 3)],
        # preempted in the middle of a run: what is computed again counts the run's tokens so far
        [("arrive", 0), ("step", [(0, 1)]), ("again", 4), ("preempt", 0), ("again", 2), ("finish", 0)],
        # one request twice in a batch: its token events stay in step order
        [("arrive", 0), ("arrive", 1), ("step", [(0, 1), (1, 1), (0, 1)]), ("again", 4), ("step", [(0, 2)])],
        # a request not in flight in the batch: no run, its outputs are counted one by one
        [("arrive", 0), ("step", [(0, 1), (5, 1)]), ("again", 3), ("arrive", 5), ("again", 2)],
        # the same id arriving again in the middle of a run: the old request's steps stay its own
        [("arrive", 0), ("arrive", 1), ("step", [(0, 1), (1, 1)]), ("again", 3), ("arrive", 1), ("again", 2)],
    ],
)
def test_runs_of_steps_give_what_steps_one_by_one_give(run):
    a, _ = _play(run, batched=False).take()
    b, _ = _play(run, batched=True).take()
    assert [_fields(r) for r in b] == [_fields(r) for r in a]


def test_step_arrays_are_trimmed_to_what_requests_in_flight_refer_to():
    tr = RequestTracker()
    tr.arrival("long", 0)
    for k in range(10_000):
        tr.arrival(f"s{k}", k)
        tr.emitted([f"s{k}"], [1], k, k)
        tr.finish(f"s{k}", k, "ok")
    assert len(tr._step_gen) < 4096 + 2  # short requests: the arrays never hold more than a trim's worth
    tr.emitted(["long"], [1], 10_000, 10_001)  # the long request's first token, step 10000
    for k in range(10_000, 30_000):
        tr.arrival(f"s{k}", k)
        tr.emitted([f"s{k}"], [1], k, k)
        tr.finish(f"s{k}", k, "ok")
    assert tr._step_base <= 10_000  # the long request's step is kept
    tr.emitted(["long"], [2], 40_000, 40_003)
    tr.finish("long", 50_000, "ok")
    rec = tr.take()[0][-1]
    assert rec.request_id == "long" and list(rec.gen_times_ns) == [10_000, 40_000]
    assert list(rec.out_times_ns) == [10_001, 40_003] and list(rec.out_tokens) == [1, 2]


def _spans(int_arrays: bool):
    tr = RequestTracker()
    tr.arrival("a", 1_000, input_tokens=4)
    for k in range(300):
        tr.emitted(["a"], [1 + (k % 3 == 0)], 2_000 + 10 * k, 2_005 + 10 * k)
    tr.finish("a", 9_000, "ok", "length")
    f = SpanFactory(make_resource("t"), "engine", "vllm", "m", "phases", int_arrays=int_arrays)
    f._ids.generate_span_id = iter(range(1, 100)).__next__  # same ids both ways
    f._ids.generate_trace_id = lambda: 0xABC
    return f.request_spans(tr.take()[0][0])


def test_int64_arrays_encode_exactly_as_lists():
    arrays, lists = _spans(True), _spans(False)
    a = dict(arrays[0].attributes)
    assert type(a[sc.TOKEN_EVENT_OFFSETS]).__name__ == "ndarray"
    assert type(dict(lists[0].attributes)[sc.TOKEN_EVENT_OFFSETS]) is list
    assert otlp_encode.encode_spans_bytes(arrays) == otlp_encode.encode_spans_bytes(lists)
    assert otlp_encode.spans_to_json(arrays) == otlp_encode.spans_to_json(lists)
    assert a[sc.OUTPUT_TOKENS] == 400 and list(a[sc.TOKEN_EVENT_TOKENS][:4]) == [2, 1, 1, 2]
    assert sc.TOKEN_GENERATED_TOKENS not in a  # the same counts as handed out: not repeated


def test_any_other_exporter_gets_lists(tmp_path):
    mem = InMemorySpanExporter()
    assert not takes_int_arrays(mem) and takes_int_arrays(FileSpanExporter(str(tmp_path / "x")))
    p = TracingPipeline(mem, detail="request")
    rec = p.recorder.record
    rec((ARRIVAL, 1, "a", None, 3, None, None))
    rec((RAW, 2, lambda tr, mono, payload: tr.emitted(["a"], [1], 5, 6), None))
    rec((FINISH, 3, "a", "ok", "stop"))
    p.process(final=True)
    (span,) = mem.get_finished_spans()
    assert type(span.attributes[sc.TOKEN_EVENT_OFFSETS]) in (list, tuple)
    assert span.attributes[sc.TOKEN_EVENT_TOKENS] in ([1], (1,))


def test_tokens_made_after_an_abort_are_counted_on_the_aborted_request():
    tr = RequestTracker(abort_grace_ns=1_000)
    for rid in ("a", "b"):
        tr.arrival(rid, 0)
    tr.emitted(["a", "b"], [1, 1], 10, 11)
    tr.finish("a", 20, "cancelled", "abort")  # the client went away; the engine core does not know yet
    tr.emitted(["a", "b"], [1, 1], 30, 31)  # the step under way when the abort was sent
    tr.emitted(["a", "b", "ghost"], [2, 1, 1], 40, 41)
    tr.generated("a", 50, 3)  # an engine with a GENERATED hook counts the same way
    tr.release_aborted(500)  # within the grace: still held
    assert [r.request_id for r in tr.take()[0]] == []
    tr.finish("b", 60, "ok", "stop")
    tr.release_aborted(20 + 1_000)
    a, b = sorted(tr.take()[0], key=lambda r: r.request_id)
    assert (a.status, a.tokens_after_abort, a.output_tokens) == ("cancelled", 6, 1)
    assert b.tokens_after_abort is None and b.output_tokens == 3
    assert tr.tokens_after_abort == 6 and tr.unknown_events == 1  # the ghost's output, never in flight
    tr.emitted(["a"], [5], 70, 71)  # after the grace: not its any more
    assert tr.unknown_events == 2 and tr.tokens_after_abort == 6


def test_held_aborted_requests_are_bounded_and_flushed(tmp_path):
    tr = RequestTracker(max_in_flight=3, abort_grace_ns=10**12)
    for k in range(5):
        tr.arrival(f"r{k}", k)
        tr.finish(f"r{k}", k, "cancelled", "abort")
    assert [r.request_id for r in tr.take()[0]] == ["r0", "r1"] and len(tr._aborted) == 3
    tr.close_all(100)  # shutdown: none is held back
    assert [r.request_id for r in tr.take()[0]] == ["r2", "r3", "r4"]
    # through the pipeline: the span says it, and a flush does not wait out the grace
    path = tmp_path / "s.jsonl"
    p = TracingPipeline(FileSpanExporter(str(path)), detail="request")
    rec, now = p.recorder.record, monotonic_ns()
    rec((ARRIVAL, now, "x", None, 3, None, None))
    rec((FINISH, now + 1, "x", "cancelled", "abort"))
    rec((RAW, now + 2, lambda tr, mono, payload: tr.emitted(["x"], [4], tr.anchor.wall_ns(mono), 6), None))
    p.process()
    assert not path.exists() or not path.read_text()  # held for the grace
    p.flush()
    from otel_llm.otlp.span_records import read_trace_file

    (span,) = read_trace_file(path)
    assert span.attributes[sc.TOKENS_AFTER_ABORT] == 4 and span.attributes[sc.STATUS] == "cancelled"
