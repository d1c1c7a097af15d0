"""Request spans others send, made ours before derivation: vLLM's own ``llm_request``
(:mod:`collector.pipeline.vllm_spans`) and SGLang's ``Req <rid>`` with its stage spans
(:mod:`collector.pipeline.sglang_spans`) as engine request spans, and a GenAI client instrumentation's span
(``chat <model>``, :mod:`collector.pipeline.genai_client_spans`) as a client request span. Each adapter turns
the sender's span into one of ours and says, in a :class:`~collector.pipeline.adopted_spans.Phases`, what
the sender measured that our phase spans would otherwise give. docs/sources.md tables what each
source gives."""

from __future__ import annotations

import numpy as np

from . import genai_client_spans, sglang_spans, vllm_spans
from .adopted_spans import Adopted


def adopt(flat: list[tuple], codes: np.ndarray, tix: np.ndarray) -> Adopted:
    """Every adapter over the spans of a batch of traces (``codes``: each span's code, ``tix``: its
    trace); the spans as they are where no sender's own span is among them."""
    out = Adopted(flat, codes, tix, np.zeros(len(flat), bool), {})
    vllm_spans.adopt(out)
    sglang_spans.adopt(out)
    genai_client_spans.adopt(out)
    return out
