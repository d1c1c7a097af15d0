"""The hot-path side: a bounded buffer of raw event tuples.

Hooks call :meth:`Recorder.record` with an event (:mod:`engine_hooks.hot_path.hook_events`: a tuple of
plain numbers and ids, its kind first).
One ``len`` check and one ``deque.append``: O(1) Python work per call, no allocation beyond the
tuple, no lock (``deque.append``/``popleft`` are atomic). When full, the event is dropped and
counted, never blocking the engine.
"""

from __future__ import annotations

from collections import deque

DEFAULT_CAPACITY = 1 << 18


class Recorder:
    __slots__ = ("_buf", "capacity", "dropped")

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self._buf: deque = deque()
        self.capacity = capacity
        self.dropped = 0

    def record(self, event: tuple) -> None:
        buf = self._buf
        if len(buf) < self.capacity:
            buf.append(event)
        else:
            self.dropped += 1

    def drain(self, limit: int | None = None) -> list[tuple]:
        """Take up to ``limit`` events (all by default), oldest first. Safe against concurrent records."""
        buf = self._buf
        n = len(buf) if limit is None else min(limit, len(buf))
        pop = buf.popleft
        return [pop() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._buf)

    def reset(self) -> None:
        """Forget every event and count, in place (the hooks hold this object's ``record``)."""
        self._buf.clear()
        self.dropped = 0
