"""Per-request accounts an engine sends apart from its requests' spans, joined to their records.

An engine whose requests are traced in another process (vLLM: the front end traces them, the
engine core schedules them) sends what only its core knows of a request as a span of its own
trace, named by ``llm.request.internal_id``: its speculative decoding
(:mod:`~collector.pipeline.speculation`), a decode engine's KV fetch
(:mod:`~collector.pipeline.kv_fetch`). Like engine steps, these spans bypass trace assembly: the
collector takes them out of each export request as it is accepted (:meth:`EngineAccounts.split`)
into a bounded :class:`AccountIndex` per kind, and each engine record derived later takes its
accounts by the internal id its ``llm.request`` span carries (:meth:`EngineAccounts.join`). An
account that comes after its record was derived leaves that record's columns unknown, and waits
in its index (``<kind>_accounts_waiting``) until the bound evicts it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from . import walked_span as sp
from .records import RecordBatch


def with_clients(batch: RecordBatch, found: list[tuple[int, Any]]) -> list[tuple[list[int], Any]]:
    """Each found engine record with the client record paired with it (whose columns copy the
    engine's): ([engine record, its client's if any], account)."""
    client_of = dict(zip(batch.pairs[1].tolist(), batch.pairs[0].tolist())) if batch.pairs is not None else {}
    return [([i] if client_of.get(i) is None else [i, client_of[i]], a) for i, a in found]


class AccountIndex:
    """One kind of account by internal id, at most ``limit`` (the oldest go first, counted in
    ``evicted``); each joins one record and is then dropped. A kind says its span ``code``, how to
    ``read`` one (None: malformed) and how to ``fill`` the records that found theirs."""

    kind: str = ""  # the counters' prefix
    code: int = -1  # the walked span code of its spans

    def __init__(self, limit: int = 100_000):
        self.limit = limit
        self._accounts: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # receivers add, the derivation worker joins
        self.received = self.joined = self.evicted = self.malformed = 0

    def __len__(self) -> int:
        return len(self._accounts)

    def read(self, span: tuple) -> Any | None:
        raise NotImplementedError

    def fill(self, batch: RecordBatch, found: list[tuple[int, Any]]) -> None:
        raise NotImplementedError

    def keys(self, batch: RecordBatch) -> list:
        """Each record's key into this index (None: none): its engine's internal id."""
        return batch.internal_id

    def add(self, spans: list[tuple]) -> None:
        """Take walked spans of this kind."""
        read = [(s[sp.INTERNAL_ID], self.read(s)) for s in spans]
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
        """Fill the columns of ``batch``'s engine records whose account is here (in place; returned
        for chaining). Keyed by an internal id alone (:meth:`keys`): an engine's ids are unique to
        it (vLLM's carry a random suffix)."""
        ids = self.keys(batch)
        if not len(self._accounts) or not any(ids):
            return batch
        with self._lock:
            found = [(i, self._accounts.pop(rid, None)) for i, rid in enumerate(ids) if rid]
        found = [(i, a) for i, a in found if a is not None]
        if found:
            self.joined += len(found)
            self.fill(batch, found)
        return batch

    def counters(self) -> dict[str, int]:
        """What the collector counts of them in its own metrics (those waiting: ``len()``)."""
        k = self.kind
        return {
            f"{k}_accounts_received": self.received,
            f"{k}_accounts_joined": self.joined,
            f"{k}_accounts_evicted": self.evicted,
            f"{k}_accounts_malformed": self.malformed,
        }


class EngineAccounts:
    """Every kind of account, split out of an export request in one pass and joined in turn."""

    def __init__(self, indexes: list[AccountIndex]):
        self.indexes = {i.code: i for i in indexes}
        self.codes = frozenset(self.indexes)

    def split(self, spans: list[tuple]) -> tuple[list[tuple], dict[int, list[tuple]]]:
        """Walked spans -> (the rest, the accounts by span code)."""
        return sp.split_codes(spans, self.codes)

    def add(self, accounts: dict[int, list[tuple]]) -> None:
        for code, spans in accounts.items():
            self.indexes[code].add(spans)

    def join(self, batch: RecordBatch) -> RecordBatch:
        for index in self.indexes.values():
            index.join(batch)
        return batch

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for index in self.indexes.values():
            out.update(index.counters())
        return out

    def waiting(self) -> dict[str, int]:
        return {f"{i.kind}_accounts_waiting": len(i) for i in self.indexes.values()}
