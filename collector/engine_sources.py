"""Request spans other engines send, made engine request spans before derivation: vLLM's own
``llm_request`` (:mod:`collector.vllm_spans`) and SGLang's ``Req <rid>`` with its stage spans
(:mod:`collector.sglang_spans`). Each adapter turns its engine's request span into one of ours and
says, in :class:`Phases`, what its engine measured that our phase spans would otherwise give.
docs/sources.md tables what each source gives."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Phases:
    """What an engine's own spans say of one request; None: not said. Durations in ns, moments in
    Unix ns."""

    front_end: int | None = None
    queue: int | None = None
    prefill: int | None = None
    decode: int | None = None
    first_scheduled: int | None = None
    first_generated: int | None = None
    generated: np.ndarray | None = None  # Unix ns of each token generated (int64), in order


@dataclass
class Adopted:
    """A batch's spans after the adapters: ``summarised`` marks the request spans whose token events
    are the first and last token only; ``phases`` is keyed by (trace index, span id)."""

    flat: list[tuple]
    codes: np.ndarray
    tix: np.ndarray
    summarised: np.ndarray
    phases: dict[tuple[int, bytes], Phases]


def adopt(flat: list[tuple], codes: np.ndarray, tix: np.ndarray) -> Adopted:
    """Every adapter over the spans of a batch of traces (``codes``: each span's code, ``tix``: its
    trace); the spans as they are where no engine's own span is among them."""
    from . import sglang_spans, vllm_spans

    out = Adopted(flat, codes, tix, np.zeros(len(flat), bool), {})
    vllm_spans.adopt(out)
    sglang_spans.adopt(out)
    return out
