"""The hook events: what a hook records on the engine's thread, declared once.

An event is a plain tuple, ``(kind, *fields)``: the cheapest thing to build on the engine's
thread (in C too: ``engine_hooks.hot_path._hotpath.MethodHook`` packs arrivals and raw events) and to
pickle to the span process. Its fields have names all the same: :data:`EVENTS` declares each kind
with its fields in tuple order, and everything else is made from that one declaration:

* the builders (:func:`arrival`, :func:`step`, ...), one per kind, with the fields as their
  parameters, which the producers call (:mod:`engine_hooks.api`, :mod:`engine_hooks.asgi`);
* the index of a field (:meth:`HookEvent.index`), for a reader that needs one field;
* the tracker's handlers (``RequestTracker._on_<name>``), whose parameters are the fields by
  name: ``tests/unit/test_hook_events.py`` checks them, the builders, and the tuples the C
  accelerator packs against this table.

A new field is one name here, its value where the event is made, and its parameter where it is
read. Times are monotonic ns of the recording process (``mono``); the tracker places them on the
wall clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# event kinds: the first element of each tuple
ARRIVAL, SCHEDULED, PREEMPTED, GENERATED, TOKEN_OUT, FINISH, STEP, RAW, QUEUED, PLAIN_RAW = range(10)


@dataclass(frozen=True)
class HookEvent:
    """One kind of hook event: the tuple ``(kind, *fields)``; ``defaults``: the values of the
    trailing fields a producer may leave out (the builder's defaults)."""

    kind: int
    name: str
    fields: tuple[str, ...]
    doc: str
    defaults: tuple = ()

    def index(self, field: str) -> int:
        """Where ``field`` is in this kind's tuples (the kind is at 0)."""
        return 1 + self.fields.index(field)


EVENTS: tuple[HookEvent, ...] = (
    HookEvent(
        ARRIVAL,
        "arrival",
        ("mono", "request_id", "start_mono", "input_tokens", "trace_headers", "attrs"),
        "the request reached the engine's front end; ``start_mono`` its arrival if the engine knows "
        "it better (else None), ``trace_headers`` a W3C carrier, ``attrs`` more span attributes",
    ),
    HookEvent(QUEUED, "queued", ("mono", "request_id"), "the request entered the scheduler's queue"),
    HookEvent(
        SCHEDULED,
        "scheduled",
        ("mono", "request_id"),
        "first scheduled, or scheduled again after a preemption",
    ),
    HookEvent(
        PREEMPTED,
        "preempted",
        ("mono", "request_id", "mode", "kv_usage", "recompute_tokens"),
        "``mode`` ``recompute`` or ``swap``; the KV cache's used fraction and the request's tokens "
        "whose KV it lost, as the engine had them when it decided (either may be None)",
        defaults=(None, None),
    ),
    HookEvent(GENERATED, "generated", ("mono", "request_id", "tokens"), "tokens produced inside the engine"),
    HookEvent(TOKEN_OUT, "token_out", ("mono", "request_id", "tokens"), "output handed to the transport"),
    HookEvent(
        FINISH,
        "finish",
        ("mono", "request_id", "status", "reason"),
        "status ``ok``, ``error``, ``cancelled`` or ``rejected``; ``reason`` the finish reason or None",
        defaults=(None,),
    ),
    HookEvent(
        STEP,
        "step",
        (
            "start_mono",
            "end_mono",
            "index",
            "batch",
            "prefill_tokens",
            "decode_tokens",
            "preempted",
            "kv_usage",
            "gpu_handle",
            "waiting",
            "speculation",
        ),
        "one engine iteration; ``gpu_handle`` its GPU timer's handle (or, read back, its GPU ns, -1 "
        "for none), ``waiting`` (requests left waiting, why) or None, ``speculation`` (draft tokens "
        "verified, of them accepted) or None (no speculative decoding)",
        defaults=(None, None, None, None),
    ),
    HookEvent(
        RAW,
        "raw",
        ("mono", "expander", "payload"),
        "``expander(tracker, mono, payload)`` unpacks an engine's own objects later, so that the hot "
        "path only keeps a reference; an expander with a ``to_plain`` "
        "(:func:`engine_hooks.api.plain_payload`) is given ``expander.to_plain(payload)``",
    ),
    HookEvent(
        PLAIN_RAW,
        "plain_raw",
        ("mono", "expander", "payload"),
        "a RAW event whose payload its expander's ``to_plain`` made plain already (by the engine's "
        "process, for its span process, which runs the expander); never recorded by a hook",
    ),
)
#: the declaration of each kind
BY_KIND: dict[int, HookEvent] = {e.kind: e for e in EVENTS}


def _builder(event: HookEvent) -> Callable[..., tuple]:
    """The function that makes ``event``'s tuple from its fields (positional or by name): written
    out and compiled once, as :func:`collections.namedtuple` does, so that it costs one call."""
    fields = list(event.fields)
    required = fields[: len(fields) - len(event.defaults)]
    params = required + [f"{f}=_d{i}" for i, f in enumerate(fields[len(required) :])]
    source = f"def {event.name}({', '.join(params)}):\n    return ({event.kind}, {', '.join(fields)})\n"
    namespace = {f"_d{i}": v for i, v in enumerate(event.defaults)}
    exec(source, namespace)
    fn = namespace[event.name]
    fn.__module__ = __name__
    fn.__doc__ = f"The {event.name} event: ``({', '.join(['kind', *fields])})``; {event.doc}."
    return fn


arrival = _builder(BY_KIND[ARRIVAL])
queued = _builder(BY_KIND[QUEUED])
scheduled = _builder(BY_KIND[SCHEDULED])
preempted = _builder(BY_KIND[PREEMPTED])
generated = _builder(BY_KIND[GENERATED])
token_out = _builder(BY_KIND[TOKEN_OUT])
finish = _builder(BY_KIND[FINISH])
step = _builder(BY_KIND[STEP])
raw = _builder(BY_KIND[RAW])
plain_raw = _builder(BY_KIND[PLAIN_RAW])

#: the builder of each kind
BUILDERS: dict[int, Callable[..., tuple]] = {e.kind: globals()[e.name] for e in EVENTS}

#: where a step event holds its GPU handle (the span process replaces it with the time read back)
STEP_GPU = BY_KIND[STEP].index("gpu_handle")
