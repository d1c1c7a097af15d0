"""Speculative decoding, request by request, as the engine verified it.

An engine that decodes speculatively proposes up to ``k`` draft tokens for a request in a step,
verifies them, and hands out the request's next token and the drafts it accepted: 1 to ``k + 1``
tokens in one output. :class:`SpeculationBook` keeps, for each request, one entry per step that
gave it tokens (the same steps, in the same order, as the token events of its ``llm.request``
span): the tokens the step gave it, the drafts it verified (-1: the step verified none, as the
request's first token, or a step whose drafter proposed nothing) and of them those accepted.

vLLM counts the same per request (``per_request_spec_decode_metrics``: its verify steps only) and
over a run (``vllm:spec_decode_num_draft_tokens`` and ``..._accepted_tokens``); the entries with
drafts are its per-step arrays. The book serves an engine whose requests are traced in another
process (vLLM's engine core): each request's account leaves as an ``llm.engine.speculation`` span
named by ``llm.request.internal_id`` (:meth:`SpanFactory.speculation_spans`), when the request
finished, was aborted, or at shutdown (marked incomplete).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .open_book import OpenBook


@dataclass
class SpeculationRecord:
    """One request's speculative decoding. Times are wall-clock ns (first and last step that gave
    it tokens); the lists hold one entry per such step."""

    request_id: str
    method: str | None  # the engine's name for how it drafts (vLLM: ngram, draft_model, eagle, ...)
    num_speculative_tokens: int | None  # k: the most drafts a step proposes
    start_ns: int
    end_ns: int
    tokens: list[int] = field(default_factory=list)  # tokens the step gave the request
    drafts: list[int] = field(default_factory=list)  # drafts it verified; -1: none this step
    accepted: list[int] = field(default_factory=list)  # of them, accepted (0 where none)
    incomplete: bool = False  # still in flight at shutdown, or evicted

    @property
    def verify_steps(self) -> int:
        return sum(1 for d in self.drafts if d >= 0)

    @property
    def draft_tokens(self) -> int:
        return sum(d for d in self.drafts if d > 0)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted)


#: one step's entry for one request: (request id, tokens given, drafts verified or -1, accepted,
#: whether the request finished in the step)
StepEntry = tuple[str, int, int, int, bool]


class SpeculationBook(OpenBook[SpeculationRecord]):
    """The speculation of the requests in flight, bounded: beyond ``max_in_flight`` the oldest
    leaves, marked incomplete (``evicted`` counts them)."""

    def steps(self, wall_ns: int, entries: Iterable[StepEntry], method: str | None, k: int | None) -> None:
        """One engine step's entries (every request it gave tokens), at ``wall_ns``."""
        book = self._open
        for rid, tokens, drafts, accepted, finished in entries:
            rec = book.get(rid)
            if rec is None:
                self.make_room()
                rec = book[rid] = SpeculationRecord(rid, method, k, wall_ns, wall_ns)
            rec.tokens.append(tokens)
            rec.drafts.append(drafts)
            rec.accepted.append(accepted)
            rec.end_ns = wall_ns
            if finished:
                self.done.append(book.pop(rid))

    def ended(self, request_ids: Sequence[str] | str) -> None:
        """Requests that ended without a finishing step (aborted): their account leaves as it is."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            rec = self._open.pop(rid, None)
            if rec is not None:
                self.done.append(rec)
