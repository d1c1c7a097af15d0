"""vLLM's speculative decoding, in its engine core: what each step verified.

Two accounts, both as vLLM's scheduler counts drafts and acceptances for its own statistics
(``update_from_output``: over the requests with drafts that sampled anything, the drafts
scheduled less those a grammar invalidated, and the tokens sampled beyond the one each request
gets anyway):

* :func:`step_speculation`: a step's totals, on its ``llm.engine.step`` span (``steps`` detail),
  on the engine's thread in C builtins (no Python frame per request);
* :func:`hook_speculation`: each request's, step by step, from ``phases`` on, for a
  scheduler built with a ``speculative_config`` only (one without it is not touched). The engine's
  thread keeps references to the step's objects (:meth:`EngineHooks.raw`); they are read off it
  (:func:`plain_speculation`) and booked in the span process
  (:class:`~engine_hooks.spans.speculation.SpeculationBook`), which sends each request's account
  as an ``llm.engine.speculation`` span when it finishes or is aborted.
"""

from __future__ import annotations

import functools
from itertools import compress, repeat

from ..api import EngineHooks, plain_already, plain_payload
from ..hot_path.batch_scan import BatchScanner
from ..spans.tracker import RequestTracker


def step_speculation(res, self, so, mro, *a, **k) -> tuple[int, int] | None:
    """(draft tokens verified, of them accepted) in the step, None where it verified none; read
    before the step's update (``res`` None), which cuts a stopped request's sampled tokens. A
    request missing from the model's output (aborted while the step ran) is skipped, in a Python
    pass, as vLLM skips it."""
    spec = so.scheduled_spec_decode_tokens
    if not spec:
        return None
    index, sampled = mro.req_id_to_index, mro.sampled_token_ids
    try:
        lengths = list(map(len, map(sampled.__getitem__, map(index.__getitem__, spec))))
        drafts = list(map(len, spec.values()))
        ids = spec
    except (KeyError, IndexError, TypeError):
        ids = [r for r in spec if r in index and index[r] < len(sampled)]
        lengths = [len(sampled[index[r]]) for r in ids]
        drafts = [len(spec[r]) for r in ids]
    drafted = sum(compress(drafts, lengths))
    invalid = so.num_invalid_spec_tokens
    if invalid:
        drafted -= sum(invalid.get(r, 0) for r, n in zip(ids, lengths) if n)
    got = len(lengths) - lengths.count(0)
    return drafted, max(sum(lengths) - getattr(self, "num_sampled_tokens_per_step", 1) * got, 0)


def _sampled(res, so, mro, *a, **k) -> list[int] | None:
    """Before the step's update, on the engine's thread: how many tokens each request sampled
    (vLLM cuts a stopped request's list in place; its accepted drafts count what it sampled), in
    C builtins; None for a step without drafts."""
    return list(map(len, mro.sampled_token_ids)) if so.scheduled_spec_decode_tokens else None


def _payload(res, self, so, mro, *a, **k) -> tuple:
    """After it, on the engine's thread: references only."""
    config = self.vllm_config.speculative_config
    return (
        res,
        so.scheduled_spec_decode_tokens,
        so.num_invalid_spec_tokens,
        mro.req_id_to_index,
        getattr(self, "num_sampled_tokens_per_step", 1),
        getattr(config, "method", None),
        getattr(self, "num_spec_tokens", None),
    )


@functools.cache
def _output_scan() -> BatchScanner:
    """The front end's scan of a step's outputs, with the finish reason its one rare field."""
    from .frontend import output_scanner

    return output_scanner(("finish_reason",))


def plain_speculation(payload: tuple) -> tuple:
    """A step's payload (what :func:`_sampled` read before it, what :func:`_payload` kept after)
    as plain data, in the engine core's process and in C builtins (no Python frame per request:
    a step's batch can be hundreds): per client's outputs, ``(request ids, token counts or None
    for one each, drafts scheduled (0: none), tokens sampled or None, the ids that finished)``;
    then the grammar-invalidated drafts, tokens sampled per step anyway, method and k. The span
    process makes the entries (:func:`expand_speculation`)."""
    sampled, (outputs, spec, invalid, index, per_step, method, k) = payload
    columns = []
    for batch in outputs.values():
        outs = batch.outputs
        if not outs:
            continue
        ids, counts, rare = _output_scan()(outs)
        drafts = list(map(len, map(spec.get, ids, repeat(()))))
        got = None
        if sampled is not None:
            try:
                got = list(map(sampled.__getitem__, map(index.__getitem__, ids)))
            except (KeyError, IndexError, TypeError):  # an output the model did not sample for
                got = [sampled[index[r]] if r in index and index[r] < len(sampled) else 0 for r in ids]
        finished = [o.request_id for o in rare if o.finish_reason is not None] if rare else []
        columns.append((ids, counts, drafts, got, finished))
    return columns, dict(invalid) if invalid else None, per_step, method, k


def step_entries(columns: list, invalid: dict | None, per_step: int) -> list:
    """The entries (:data:`~engine_hooks.spans.speculation.StepEntry`) of a step's plain columns:
    one per output that gave its request tokens; drafts -1 where it had none to verify."""
    entries = []
    for ids, counts, drafts, got, finished in columns:
        done = set(finished)
        for i, rid in enumerate(ids):
            n = counts[i] if counts is not None else 1
            if not n:
                continue
            d = drafts[i]
            if d:
                d -= invalid.get(rid, 0) if invalid else 0
                accepted = max((got[i] if got is not None else 0) - per_step, 0)
                entries.append((rid, n, d, accepted, rid in done))
            else:
                entries.append((rid, n, -1, 0, rid in done))
    return entries


@plain_payload(plain_speculation)
def expand_speculation(tracker: RequestTracker, mono_ns: int, payload: tuple) -> None:
    """Book one step's entries (in the span process)."""
    columns, invalid, per_step, method, k = payload
    tracker.speculation.steps(tracker.anchor.wall_ns(mono_ns), step_entries(columns, invalid, per_step), method, k)


def _aborted_ids(res, *a, **k) -> tuple[list[str], None]:
    return [r.request_id for r in res or ()], None


@plain_already
def expand_aborted(tracker: RequestTracker, mono_ns: int, payload: tuple) -> None:
    """Requests the scheduler was told to finish (aborts): their accounts leave as they are."""
    tracker.speculation.ended(payload[0])


def hook_speculation(scheduler, hooks: EngineHooks) -> bool:
    """Have one scheduler, built with a ``speculative_config``, book its requests' drafts: its
    ``update_from_output`` and ``finish_requests`` are wrapped on the instance (one without it is
    not touched: returns False)."""
    if getattr(getattr(scheduler, "vllm_config", None), "speculative_config", None) is None:
        return False
    update = hooks.raw(lambda res, so, mro, *a, **k: _payload(res, scheduler, so, mro), expand_speculation, _sampled)
    scheduler.update_from_output = update(scheduler.update_from_output)
    scheduler.finish_requests = hooks.raw(_aborted_ids, expand_aborted)(scheduler.finish_requests)
    return True
