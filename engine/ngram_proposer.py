"""Draft tokens by prompt lookup (vLLM's ``ngram`` speculative method).

A request's last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
are looked up among its earlier tokens, prompt and output alike; the tokens that followed the
latest earlier occurrence are the draft. The target model then scores the last token and every
draft token in one step (``Scheduler``); a greedy request keeps the drafts that match its own
argmax, plus the token it samples after the last match, so its output is what it would be
without drafts (in bfloat16, up to near-ties that a differently shaped batch can flip).

Lookups are O(1): each request keeps an index from every n-gram it has seen to the position
after its latest occurrence, extended by the tokens appended since the last lookup.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request

# Tokens past which ``NgramIndex.extend`` indexes in bulk.
_BULK_TOKENS = 8


@dataclass(slots=True)
class NgramIndex:
    """For each ``n`` in ``[min_n, max_n]``: n-gram → the position just after its latest
    occurrence that is not the suffix (an n-gram enters when the token after it arrives)."""

    min_n: int
    max_n: int
    num_indexed_tokens: int = 0
    positions: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, token_ids: list[int]) -> None:
        """Index the n-grams that end before each token appended since the last call."""
        start, end = max(self.num_indexed_tokens, 1), len(token_ids)
        if end - start > _BULK_TOKENS:
            self._extend_bulk(token_ids, start, end)
        else:  # a decode step's token or few: a plain loop costs least
            for pos in range(start, end):
                for n in range(self.min_n, min(self.max_n, pos) + 1):
                    self.positions[tuple(token_ids[pos - n : pos])] = pos
        self.num_indexed_tokens = end

    def _extend_bulk(self, token_ids: list[int], start: int, end: int) -> None:
        """``extend``'s loop for many tokens (a prompt's index, built on its first decode),
        with the n-grams built and stored in C; for each n the later positions overwrite the
        earlier ones' entries, as the loop does."""
        for n in range(self.min_n, self.max_n + 1):
            first = max(start, n)
            if first >= end:
                continue
            columns = (token_ids[first - n + k : end - n + k] for k in range(n))
            self.positions.update(zip(zip(*columns, strict=True), range(first, end), strict=True))

    def draft(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the longest suffix seen before ([] if
        none). ``token_ids`` must be what ``extend`` last indexed."""
        for n in range(min(self.max_n, len(token_ids)), self.min_n - 1, -1):
            pos = self.positions.get(tuple(token_ids[-n:]))
            if pos is not None:
                return token_ids[pos : pos + max_tokens]
        return []


class NgramProposer:
    """Proposes each greedy decode request's draft for the next step (scheduler only)."""

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """The draft for ``request`` (at most ``min(max_tokens, num_speculative_tokens)``).

        Side effect: the request's index catches up with its tokens (built on first use).
        """
        num_tokens = min(max_tokens, self.num_speculative_tokens)
        if num_tokens <= 0:
            return []
        index = self._indexes.get(request.req_id)
        if index is None:
            index = NgramIndex(self.prompt_lookup_min, self.prompt_lookup_max)
            self._indexes[request.req_id] = index
        token_ids = request.all_token_ids
        index.extend(token_ids)
        return index.draft(token_ids, num_tokens)

    def forget(self, req_id: str) -> None:
        """Drop a finished request's index. Unknown ids are ignored."""
        self._indexes.pop(req_id, None)
