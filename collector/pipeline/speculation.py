"""Speculative decoding: the engine's account of each request, joined to its record.

An engine whose requests are traced in another process (vLLM: the front end traces them, the
engine core drafts and verifies) sends each request's account as an ``llm.engine.speculation``
span of its own trace, named by ``llm.request.internal_id`` (engine_hooks/spans/speculation.py):
per step that gave the request tokens, the tokens, the drafts verified (-1: none) and those
accepted. They bypass trace assembly and join their records by that id
(:mod:`~collector.pipeline.engine_accounts`: :class:`SpeculationIndex` is this kind's index). The
account is sent at the request's end, as its ``llm.request`` span is, and records are derived a
trace grace (``--trace-grace``) after that: an account later still leaves its record's
speculation unknown.

The arithmetic (:func:`acceptance`) is vLLM's: acceptance rate = accepted / drafted, mean
acceptance length = 1 + accepted / verify steps (docs/metrics/speculative.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import walked_span as sp
from .engine_accounts import AccountIndex, with_clients
from .records import RecordBatch
from .stalls import gap_end_events


def acceptance(draft_tokens: np.ndarray, accepted: np.ndarray, verify_steps: np.ndarray) -> tuple[np.ndarray, ...]:
    """(acceptance rate, mean acceptance length) per request: accepted / drafted, and
    1 + accepted / verify steps; NaN (unknown) where the divisor is 0 or unknown (-1)."""
    d, a, v = (np.asarray(x, np.float64) for x in (draft_tokens, accepted, verify_steps))
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where((d > 0) & (a >= 0), a / d, np.nan)
        length = np.where((v > 0) & (a >= 0), 1.0 + a / v, np.nan)
    return rate, length


def own_columns(fields: list, n: int) -> dict[str, object]:
    """The speculation columns (records.COLUMNS declares them) of ``n`` records from their own
    spans' fields: a client's copy of its server's account (``llm.speculation.*`` totals on
    ``llm.client.request``: vLLM's response metrics), unknown elsewhere, and where any of the three
    counts is missing or not a non-negative int. An engine record's come from the join."""
    counts = (
        [
            np.fromiter((v if type(v) is int and 0 <= v < 2**62 else -1 for v in fields[i]), np.int64, n)
            for i in (sp.SPEC_DRAFT_TOKENS, sp.SPEC_ACCEPTED_TOKENS, sp.SPEC_VERIFY_STEPS)
        ]
        if n
        else [np.zeros(0, np.int64)] * 3
    )
    whole = (counts[0] >= 0) & (counts[1] >= 0) & (counts[2] >= 0)
    for c in counts:
        c[~whole] = -1
    rate, length = acceptance(*counts)
    return {
        "spec_method": [None] * n,
        "draft_tokens": counts[0],
        "accepted_tokens": counts[1],
        "verify_steps": counts[2],
        "acceptance_rate": rate,
        "mean_acceptance_length": length,
        "gap_step_draft_tokens": np.full(n, -1, np.int64),  # only the engine's per-step account says
        "gap_step_accepted_tokens": np.full(n, -1, np.int64),
    }


def _small(x: np.ndarray) -> np.ndarray:
    """A per-step array as an account keeps it: int16, clipped."""
    return np.clip(x, -1, 2**15 - 1).astype(np.int16)


def split_accounts(spans: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """Walked spans -> (the rest, the ``llm.engine.speculation`` accounts)."""
    return sp.split_code(spans, sp.SPECULATION)


@dataclass(frozen=True)
class Account:
    """One request's speculation, as its engine sent it: the totals of its per-step arrays, and
    the arrays (one entry per step that gave the request tokens: its tokens, the drafts it verified,
    -1: none, and those accepted; int16, clipped: an account waits in a bounded index)."""

    method: str | None
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    step_tokens: np.ndarray | None = field(default=None, compare=False)
    step_drafts: np.ndarray | None = field(default=None, compare=False)
    step_accepted: np.ndarray | None = field(default=None, compare=False)

    def step_of_token(self, token: int) -> tuple[int, int] | None:
        """(drafts verified, accepted) of the step that gave the request its ``token``-th token
        (1: the first), 0 drafts for a step that verified none; None beyond the steps'
        tokens, or without the per-step arrays."""
        if self.step_tokens is None or token < 1:
            return None
        k = int(np.searchsorted(np.cumsum(self.step_tokens, dtype=np.int64), token, side="left"))
        if k >= len(self.step_tokens):
            return None
        d = int(self.step_drafts[k])
        return (d, int(self.step_accepted[k])) if d >= 0 else (0, 0)

    @classmethod
    def from_walked(cls, s: tuple) -> Account | None:
        """The account of a walked span (int arrays as the walker gives them: int64 bytes); None
        where its arrays are missing, of other lengths, or hold a negative acceptance."""
        drafts, accepted = s[sp.SPEC_EVENT_DRAFTS], s[sp.SPEC_EVENT_ACCEPTED]
        if type(drafts) is not bytes or type(accepted) is not bytes or len(drafts) != len(accepted):
            return None
        d, a = np.frombuffer(drafts, np.int64), np.frombuffer(accepted, np.int64)
        if (a < 0).any() or (d < -1).any():
            return None
        verify = d >= 0
        method = s[sp.SPEC_METHOD]
        tokens = s[sp.SPEC_EVENT_TOKENS]
        steps = np.frombuffer(tokens, np.int64) if type(tokens) is bytes and len(tokens) == len(drafts) else None
        if steps is not None and (steps < 1).any():  # a step gave its request a token at least: else not kept
            steps = None
        return cls(
            method[:64] if type(method) is str else None,
            int(d[verify].sum()),
            int(a[verify].sum()),
            int(verify.sum()),
            *((_small(steps), _small(d), _small(a)) if steps is not None else ()),
        )


class SpeculationIndex(AccountIndex):
    """Speculation accounts by internal id (:class:`~collector.pipeline.engine_accounts.AccountIndex`)."""

    kind, code = "speculation", sp.SPECULATION

    def read(self, span: tuple) -> Account | None:
        return Account.from_walked(span)

    def fill(self, batch: RecordBatch, found: list[tuple[int, Account]]) -> None:
        for i, account in found:
            batch.spec_method[i] = account.method
            batch.draft_tokens[i] = account.draft_tokens
            batch.accepted_tokens[i] = account.accepted_tokens
            batch.verify_steps[i] = account.verify_steps
        said = batch.draft_tokens >= 0
        if said.any():
            rate, length = acceptance(batch.draft_tokens, batch.accepted_tokens, batch.verify_steps)
            batch.acceptance_rate[said], batch.mean_acceptance_length[said] = rate[said], length[said]
        gap_steps(batch, found)


def gap_steps(batch: RecordBatch, found: list[tuple[int, Account]]) -> None:
    """``gap_step_*`` of the engine records that found their account (in place): the drafts
    verified and accepted by the step that gave the last token of the event ending the largest gap
    (the client's, for a paired record: :func:`~collector.pipeline.stalls.gap_end_events`),
    copied to the paired client record."""
    end = gap_end_events(batch.event_offsets_ns, batch.event_start, batch.pairs)
    st, tokens = batch.event_start, batch.event_tokens
    for rows, account in with_clients(batch, found):
        i = rows[0]
        if end[i] < 1:
            continue
        step = account.step_of_token(int(tokens[st[i] : st[i] + end[i] + 1].sum()))
        if step is not None:
            batch.gap_step_draft_tokens[rows], batch.gap_step_accepted_tokens[rows] = step
