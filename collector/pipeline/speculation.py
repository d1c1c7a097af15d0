"""Speculative decoding: the engine's account of each request, joined to its record.

An engine whose requests are traced in another process (vLLM: the front end traces them, the
engine core drafts and verifies) sends each request's account as an ``llm.engine.speculation``
span of its own trace, named by ``llm.request.internal_id`` (engine_hooks/spans/speculation.py):
per step that gave the request tokens, the tokens, the drafts verified (-1: none) and those
accepted. Like engine steps, these spans bypass trace assembly: the collector takes them out of
each export request as it is accepted (:func:`split_accounts`) into a bounded
:class:`SpeculationIndex`, and joins each engine record derived later with its account by the
internal id its ``llm.request`` span carries (:meth:`SpeculationIndex.join`). The account is sent
at the request's end, as its ``llm.request`` span is, and records are derived a trace grace
(``--trace-grace``) after that: an account later still leaves its record's speculation unknown,
and waits in the index (``speculation_accounts_waiting``) until the bound evicts it.

The arithmetic (:func:`acceptance`) is vLLM's: acceptance rate = accepted / drafted, mean
acceptance length = 1 + accepted / verify steps (docs/metrics/speculative.md).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from . import walked_span as sp
from .records import RecordBatch


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
    }


def split_accounts(spans: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """Walked spans -> (the rest, the ``llm.engine.speculation`` accounts)."""
    return sp.split_code(spans, sp.SPECULATION)


@dataclass(frozen=True)
class Account:
    """One request's speculation, as its engine sent it (totals of its per-step arrays)."""

    method: str | None
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int

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
        return cls(
            method[:64] if type(method) is str else None,
            int(d[verify].sum()),
            int(a[verify].sum()),
            int(verify.sum()),
        )


class SpeculationIndex:
    """Accounts by internal id, at most ``limit`` (the oldest go first, counted in
    ``evicted``); each joins one record and is then dropped."""

    def __init__(self, limit: int = 100_000):
        self.limit = limit
        self._accounts: OrderedDict[str, Account] = OrderedDict()
        self._lock = threading.Lock()  # receivers add, the derivation worker joins
        self.received = self.joined = self.evicted = self.malformed = 0

    def __len__(self) -> int:
        return len(self._accounts)

    def add(self, spans: list[tuple]) -> None:
        """Take walked ``llm.engine.speculation`` spans."""
        read = [(s[sp.INTERNAL_ID], Account.from_walked(s)) for s in spans]
        with self._lock:
            for rid, account in read:
                self.received += 1
                if account is None or type(rid) is not str or not rid:
                    self.malformed += 1
                    continue
                self._accounts[rid] = account
                self._accounts.move_to_end(rid)
                if len(self._accounts) > self.limit:
                    self._accounts.popitem(last=False)
                    self.evicted += 1

    def join(self, batch: RecordBatch) -> RecordBatch:
        """Fill the speculation columns of ``batch``'s engine records whose account is here (in
        place; returned for chaining). Accounts are keyed by the internal id alone: an engine's
        ids are unique to it (vLLM's carry a random suffix)."""
        ids = batch.internal_id
        if not len(self._accounts) or not any(ids):
            return batch
        with self._lock:
            found = [(i, self._accounts.pop(rid, None)) for i, rid in enumerate(ids) if rid]
        for i, account in found:
            if account is None:
                continue
            self.joined += 1
            batch.spec_method[i] = account.method
            batch.draft_tokens[i] = account.draft_tokens
            batch.accepted_tokens[i] = account.accepted_tokens
            batch.verify_steps[i] = account.verify_steps
        said = batch.draft_tokens >= 0
        if said.any():
            rate, length = acceptance(batch.draft_tokens, batch.accepted_tokens, batch.verify_steps)
            batch.acceptance_rate[said], batch.mean_acceptance_length[said] = rate[said], length[said]
        return batch

    def counters(self) -> dict[str, int]:
        """What the collector counts of them in its own metrics (those waiting: ``len()``)."""
        return {
            "speculation_accounts_received": self.received,
            "speculation_accounts_joined": self.joined,
            "speculation_accounts_evicted": self.evicted,
            "speculation_accounts_malformed": self.malformed,
        }
