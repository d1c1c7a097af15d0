"""GPU time per engine step with CUDA events, never synchronising the step.

``start()`` records an event after the scheduler has planned the step, ``stop()`` one when the
step's output is back; ``elapsed_ns()`` is called later on the span-building thread and returns
``None`` until the end event has completed (``Event.query()``), so nothing waits on the GPU.
Events are pooled and reused. On the CPU there is no timer and the attribute is absent.
"""
from __future__ import annotations


class CudaEventTimer:
    def __init__(self, cuda=None, max_pool: int = 4096):
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self._pool: list = []
        self.max_pool = max_pool

    @classmethod
    def if_available(cls) -> "CudaEventTimer | None":
        """A timer when CUDA is usable in this process, else None."""
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                return cls(torch.cuda)
        except Exception:  # noqa: BLE001
            pass
        return None

    def _event(self):
        try:
            return self._pool.pop()
        except IndexError:
            return self._cuda.Event(enable_timing=True)

    def start(self) -> list:
        ev = self._event()
        ev.record()
        return [ev, None]

    def stop(self, handle: list) -> None:
        ev = self._event()
        ev.record()
        handle[1] = ev

    def elapsed_ns(self, handle: list) -> int | None:
        start, end = handle
        if end is None or not end.query():
            return None
        ns = int(start.elapsed_time(end) * 1e6)  # elapsed_time is in ms
        if len(self._pool) < self.max_pool:
            self._pool.extend((start, end))
        return ns
