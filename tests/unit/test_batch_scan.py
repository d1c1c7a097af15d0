"""The engine-thread scan of a step's outputs (engine_hooks.hot_path.batch_scan): the C pass and the Python
one give the same answer on vLLM's real EngineCoreOutput objects, whatever the batch holds, and
anything the C pass was not made for goes through Python rather than failing the engine."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_hooks.hot_path import batch_scan
from engine_hooks.hot_path.batch_scan import BatchScanner
from engine_hooks.vllm.frontend import RARE_FIELDS, output_scanner

vllm_engine = pytest.importorskip("vllm.v1.engine")
EngineCoreOutput = vllm_engine.EngineCoreOutput
EngineCoreEvent = vllm_engine.EngineCoreEvent
EngineCoreEventType = vllm_engine.EngineCoreEventType
FinishReason = vllm_engine.FinishReason

needs_c = pytest.mark.skipif(
    not batch_scan.accelerated(), reason="the C accelerator is not built here, or this run is pure Python"
)

# one output: which request (a small id space, so batches repeat), how many tokens, and what rare
# field it carries (a FinishReason of 0, STOP, is set: it is not None)
outputs = st.tuples(
    st.integers(0, 6),
    st.sampled_from([0, 1, 1, 1, 2, 7]),
    st.sampled_from([None, "events", "finish_stop", "finish_length", "prefill"]),
)
steps = st.lists(st.lists(outputs, max_size=8), max_size=12)


def _make(spec) -> list:
    out = []
    for rid, n, rare in spec:
        kw = {}
        if rare == "events":
            kw["events"] = [EngineCoreEvent(EngineCoreEventType.SCHEDULED, 1.0)]
        elif rare == "finish_stop":
            kw["finish_reason"] = FinishReason.STOP
        elif rare == "finish_length":
            kw["finish_reason"] = FinishReason.LENGTH
        elif rare == "prefill":
            from vllm.v1.metrics.stats import PrefillStats

            kw["prefill_stats"] = PrefillStats()
        # a new str each step, as msgspec decodes it: equal by value, not the same object
        out.append(EngineCoreOutput("".join(["req-", str(rid)]), [5] * n, **kw))
    return out


def _expected(items, previous):
    ids = [o.request_id for o in items]
    counts = [len(o.new_token_ids) for o in items]
    rare = [o for o in items if any(getattr(o, f) is not None for f in RARE_FIELDS)]
    same = previous is not None and ids == previous
    return ids, (None if all(c == 1 for c in counts) else counts), (rare or None), same


@settings(max_examples=200, deadline=None)
@given(steps)
def test_c_and_python_give_the_same_answer_step_after_step(spec):
    scan = output_scanner()
    last_c = last_py = None
    for step in spec:
        items = _make(step)
        ids, counts, rare, same = _expected(items, last_c)
        answers = (("c", scan(items, last_c), last_c), ("python", scan.scan_python(items, last_py), last_py))
        for name, got, last in answers:
            assert got[0] == ids and got[1] == counts, name
            assert (got[2] or None) == rare and all(a is b for a, b in zip(got[2] or (), rare or ())), name
            # the same batch again: the previous list itself (the tracker then knows it without comparing)
            assert (got[0] is last) == same, name
        last_c = scan(items, last_c)[0]
        last_py = scan.scan_python(items, last_py)[0]


@needs_c
def test_the_c_pass_is_used_on_vllms_outputs_and_reads_the_slots():
    scan = output_scanner()
    assert scan._c is not None  # vLLM's outputs are msgspec structs: member descriptors, read in C
    items = _make([(1, 1, None), (2, 3, "finish_stop"), (3, 1, None)])
    ids, counts, rare = batch_scan._hotpath.Scanner(*scan._c)(items, None)
    assert scan.c_scan(items, None) == (ids, counts, rare)
    assert ids == ["req-1", "req-2", "req-3"] and counts == [1, 3, 1] and rare == [items[1]]


def test_what_the_c_pass_was_not_made_for_goes_through_python():
    scan = output_scanner()

    class Other:  # not an EngineCoreOutput: a stand-in, a subclass, a mock
        def __init__(self, rid, n):
            self.request_id, self.new_token_ids = rid, [0] * n
            self.events = self.prefill_stats = self.finish_reason = None

    mixed = [*_make([(1, 1, None)]), Other("o", 2)]
    assert scan(mixed) == (["req-1", "o"], [1, 2], None)
    assert scan(tuple(_make([(1, 1, "events")])))[0] == ["req-1"]  # not a list: Python too
    assert scan([]) == ([], None, None)


def test_the_c_pass_refuses_what_would_read_the_wrong_memory():
    if batch_scan._hotpath is None:
        pytest.skip("the C accelerator is not built here")
    c = batch_scan._hotpath
    members = [EngineCoreOutput.__dict__[f] for f in ("request_id", "new_token_ids", *RARE_FIELDS)]
    items = _make([(1, 1, None)])

    class Plain:
        __slots__ = ("a",)

    # a descriptor of another class, a property, too many rare members: refused, nothing read
    with pytest.raises(TypeError):
        c.Scanner(EngineCoreOutput, Plain.__dict__["a"], members[1], tuple(members[2:]))
    with pytest.raises(TypeError):
        c.Scanner(EngineCoreOutput, property(lambda s: 1), members[1], tuple(members[2:]))
    with pytest.raises(TypeError):
        c.Scanner(EngineCoreOutput, members[0], members[1], (members[2], Plain.__dict__["a"]))
    with pytest.raises(ValueError):
        c.Scanner(EngineCoreOutput, members[0], members[1], tuple(members[2:]) * 3)
    scanner = c.Scanner(EngineCoreOutput, members[0], members[1], tuple(members[2:]))
    with pytest.raises(TypeError):
        scanner((1, 2), None)  # not a list
    with pytest.raises(TypeError):
        scanner([Plain()], None)  # not of the class it was made for
    with pytest.raises(TypeError):
        scanner(items)  # two arguments
    assert scanner(items, None)[0] == ["req-1"]


def test_pure_python_is_honoured(monkeypatch):
    monkeypatch.setenv("OTEL_LLM_PURE_PYTHON", "1")
    assert not batch_scan.accelerated()
    scan = BatchScanner(EngineCoreOutput, "request_id", "new_token_ids", RARE_FIELDS)
    assert scan._c is None
    assert scan(_make([(1, 2, None)])) == (["req-1"], [2], None)


class _Out:
    """An output whose id and token list are Python objects that can run code mid-scan."""

    __slots__ = ("finish_reason", "new_token_ids", "request_id")

    def __init__(self, rid, toks, finish=None):
        self.request_id, self.new_token_ids, self.finish_reason = rid, toks, finish


class _Id:
    """A request id whose ``__eq__`` runs ``action`` once (then compares by text)."""

    def __init__(self, text, action=None):
        self.text, self.action = text, action

    def __eq__(self, other):
        if self.action is not None:
            action, self.action = self.action, None
            action()
        return isinstance(other, _Id) and other.text == self.text

    __hash__ = None


class _Tokens(list):
    """A token list whose ``__len__`` runs ``action`` once."""

    def __init__(self, n, action=None):
        super().__init__([5] * n)
        self.action = action

    def __len__(self):
        if self.action is not None:
            action, self.action = self.action, None
            action()
        return super().__len__()


@needs_c
@pytest.mark.parametrize(
    "mutation",
    ["clear items", "clear previous", "replace items", "shrink items", "grow items", "drop an id", "len clears"],
)
def test_code_run_by_the_scan_that_changes_the_lists_never_reads_freed_memory(mutation):
    """The C scan calls into Python (an id's __eq__, a token list's __len__); that code may change
    the very lists being scanned or drop the last reference to the item being read. The scan holds
    what it reads and stops where a list changed size (TypeError: the scanner then reads through
    Python); it never reads an item that is gone (run under the debug allocator, a read of freed
    memory would crash or give garbage)."""
    scanner = BatchScanner(_Out, "request_id", "new_token_ids", ("finish_reason",))
    n = 6
    items = [_Out(_Id(f"r{i}"), [5]) for i in range(n)]
    previous = [_Id(f"r{i}") for i in range(n)]
    actions = {
        "clear items": items.clear,
        "clear previous": previous.clear,
        "replace items": lambda: items.__setitem__(slice(None), [_Out(_Id("x"), [5, 5])] * n),
        "shrink items": lambda: items.pop(),
        "grow items": lambda: items.extend(_Out(_Id("y"), [5]) for _ in range(100)),
        "drop an id": lambda: setattr(items[2], "request_id", _Id("other")),
    }
    if mutation == "len clears":
        items[2].new_token_ids = _Tokens(3, items.clear)
    else:
        items[2].request_id = _Id("r2-changed", actions[mutation])  # compared with previous[2]
    before = list(items)  # what the scan was given (the objects stay alive for the check below)
    try:
        ids, counts, rare = scanner.c_scan(items, previous)
    except TypeError:  # a list changed size: the caller's Python pass reads what is there now
        ids, counts, rare = scanner.scan_python(items, previous)
        assert ids == [o.request_id for o in items] or ids is previous
        return
    assert len(ids) == len(before) and all(isinstance(i, _Id) for i in ids)
    assert counts is None or len(counts) == len(before)
    assert rare is None


@needs_c
def test_a_scan_whose_list_changes_falls_back_to_python_through_the_scanner():
    """Through the scanner (what the hook calls): a list cleared mid-scan gives the Python answer
    for the list as it is then, never an exception into the engine."""
    scanner = BatchScanner(_Out, "request_id", "new_token_ids", ("finish_reason",))
    items = [_Out(f"r{i}", [5]) for i in range(4)]
    items[1].new_token_ids = _Tokens(2, items.clear)
    assert scanner(items, None) == ([], None, None)
