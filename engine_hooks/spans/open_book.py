"""What the books of per-request accounts share (:mod:`~engine_hooks.spans.speculation`,
:mod:`~engine_hooks.spans.kv_fetch`'s fetches and holds): the accounts of the requests in flight, bounded, and those
done, waiting to leave as spans."""

from __future__ import annotations

from typing import Generic, TypeVar

R = TypeVar("R")  # a record with an ``incomplete`` flag


class OpenBook(Generic[R]):
    """Accounts in flight by request id, at most ``max_in_flight``: :meth:`make_room` sends the
    oldest out, marked incomplete (``evicted`` counts them); :meth:`take` hands over those done."""

    def __init__(self, max_in_flight: int = 100_000):
        self.max_in_flight = max_in_flight
        self._open: dict[str, R] = {}
        self.done: list[R] = []
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._open)

    def make_room(self) -> None:
        """Before opening an account: the oldest leaves if the book is full."""
        if len(self._open) >= self.max_in_flight:
            old = self._open.pop(next(iter(self._open)))
            old.incomplete = True
            self.evicted += 1
            self.done.append(old)

    def close_all(self, wall_ns: int | None = None) -> None:
        """Shutdown: every account still open leaves, marked incomplete; one that has an end
        (``end_ns``) ends no earlier than ``wall_ns``."""
        for rec in self._open.values():
            if wall_ns is not None and hasattr(rec, "end_ns"):
                rec.end_ns = max(rec.end_ns, wall_ns)
            rec.incomplete = True
            self.done.append(rec)
        self._open.clear()

    def take(self) -> list[R]:
        done, self.done = self.done, []
        return done
