"""The C accelerators: whether one runs, decided in one place for all three.

Three optional extensions are built with the package (``setup.py``; without a C compiler the
install goes on): ``engine_hooks.hot_path._hotpath`` (an engine step's outputs scanned, the arrival and
raw hooks, the HTTP span's chunk timer), ``collector.receivers._otlp_walk`` (OTLP protobuf walked
without protobuf objects) and ``otel_llm.otlp._int_text`` (integer arrays written as OTLP/JSON
text). Each package imports its own (``None`` where it was not built) and asks :func:`on` whether
to use it, each time it decides: ``OTEL_LLM_PURE_PYTHON=1`` turns every accelerator off, read
when asked (a test, or a process that sets it after import, gets what it set). The Python twins
give the same results; ``make test-pure`` runs the quick suite with the accelerators off.
"""

from __future__ import annotations

import os
from types import ModuleType

from . import environment


def pure_python() -> bool:
    """Whether ``OTEL_LLM_PURE_PYTHON`` turns the accelerators off (unset, the usual case, is
    looked up alone: an HTTP server asks for each connection it takes)."""
    return os.environ.get(environment.PURE_PYTHON) is not None and environment.env_bool(environment.PURE_PYTHON)


def on(module: ModuleType | None) -> bool:
    """Whether the accelerator ``module`` (None: not built here) runs now."""
    return module is not None and not pure_python()


def active(module: ModuleType | None) -> ModuleType | None:
    """``module`` where it runs now (:func:`on`), else None."""
    return module if module is not None and not pure_python() else None
