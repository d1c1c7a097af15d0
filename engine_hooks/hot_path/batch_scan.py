"""One pass over an engine step's outputs, on the engine's thread: request ids, token counts and
the few outputs that carry something rare.

A batching engine hands out one output per running request at every step, and the tracing needs
three things of each: its request id, its token count, and whether it carries an event or a
finish reason. :class:`BatchScanner` reads them in C (``engine_hooks.hot_path._hotpath``, built with the
package; about 60 instructions per output, against about 1,800 for the same reads through
``operator.attrgetter``), and in Python where the accelerator is not built, where
``OTEL_LLM_PURE_PYTHON=1``, or where an output is not of the class it was made for. Both give the
same answer (``tests/unit/test_batch_scan.py``).

The answer, ``(ids, counts, rare)``:

* ``ids``: the request ids in order; the *previous* step's list object itself when they are the
  same (a steady batch: the tracker then knows it without comparing, :meth:`RequestTracker.emitted`);
* ``counts``: None when every output carries one token, else the counts in order;
* ``rare``: None, or the outputs any of whose rare fields is not None.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import compress, repeat

from otel_llm import accelerator

try:
    from . import _hotpath
except ImportError:  # no C compiler at install: the Python scan
    _hotpath = None


def accelerated() -> bool:
    """Whether the hooks' C accelerator runs here (steps scanned, HTTP body chunks timed in C)."""
    return accelerator.on(_hotpath)


class BatchScanner:
    """Scans lists of ``cls`` instances: ``id_field`` (the request id), ``count_field`` (a list:
    its length is the token count) and ``rare_fields`` (any not None: the output is rare)."""

    def __init__(self, cls: type, id_field: str, count_field: str, rare_fields: Sequence[str]):
        self._ids = operator.attrgetter(id_field)
        self._tokens = operator.attrgetter(count_field)
        self._rare = [operator.attrgetter(f) for f in rare_fields]
        members = [cls.__dict__.get(f) for f in (id_field, count_field, *rare_fields)]
        c_ok = accelerated() and all(type(m).__name__ == "member_descriptor" for m in members)
        self._c = (cls, members[0], members[1], tuple(members[2:])) if c_ok else None
        #: ``c_scan(items, previous)``: the C pass with this scanner's class and members bound
        #: (``_hotpath.Scanner``: no Python frame), or None; TypeError / AttributeError for items it
        #: was not made for
        self.c_scan = _hotpath.Scanner(*self._c) if c_ok else None

    def __call__(self, items: list, previous: list | None = None) -> tuple[list, list[int] | None, list | None]:
        if self.c_scan is not None:
            try:
                return self.c_scan(items, previous)
            except (TypeError, AttributeError):  # not the class it was made for: read through Python
                pass
        return self.scan_python(items, previous)

    def scan_python(self, items: Sequence, previous: list | None = None) -> tuple[list, list[int] | None, list | None]:
        """The same answer as the C scan, read through Python."""
        ids = list(map(self._ids, items))
        if previous is not None and ids == previous:
            ids = previous
        counts = list(map(len, map(self._tokens, items)))
        if counts.count(1) == len(counts):
            counts = None
        set_ = [map(operator.is_not, map(get, items), repeat(None)) for get in self._rare]
        rare = list(compress(items, map(any, zip(*set_))))
        return ids, counts, rare or None
