"""Every kind of per-request account the collector joins to its records
(:mod:`~collector.pipeline.engine_accounts`): speculative decoding, a decode engine's KV fetch, a prefill engine's
KV hold, a connector worker's transfers."""

from __future__ import annotations

from .engine_accounts import EngineAccounts
from .kv_fetch import KvFetchIndex, KvHoldIndex, KvTransportIndex
from .speculation import SpeculationIndex


def every_kind(limit: int) -> EngineAccounts:
    """An index for each kind, each of at most ``limit`` accounts."""
    return EngineAccounts([SpeculationIndex(limit), KvFetchIndex(limit), KvHoldIndex(limit), KvTransportIndex(limit)])
