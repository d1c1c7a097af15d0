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
        self._ready = False

    @classmethod
    def if_available(cls) -> CudaEventTimer | None:
        """A timer when this process can use CUDA, else None (the CPU: no GPU time attribute).

        Built when the plugin loads, before the model is on the GPU: events are only recorded
        once this process has a CUDA context (the model runs here: vLLM's single-GPU executor);
        until then, and in a process that never gets one, ``start`` returns None."""
        try:
            import torch

            if torch.cuda.is_available():
                return cls(torch.cuda)
        except Exception:
            pass
        return None

    def _event(self):
        try:
            return self._pool.pop()
        except IndexError:
            return self._cuda.Event(enable_timing=True)

    def start(self) -> list | None:
        if not self._ready:
            init = getattr(self._cuda, "is_initialized", None)
            if init is not None and not init():
                return None
            self._ready = True
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
