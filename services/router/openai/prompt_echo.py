"""The prompt's part of a response: completions' ``echo`` and vLLM's ``prompt_logprobs``.

``echo`` puts each prompt's text before its choices' text and, with ``logprobs``, the prompt
tokens' entries before the generated ones (the first token's logprob and alternatives are
null: nothing precedes it); ``max_tokens: 0`` with echo returns the prompt alone. The
``prompt_logprobs`` field (per choice in completions, once per response in chat) is vLLM's:
``null`` for the first token, then per token a map from token id to its ``logprob``, ``rank``
and ``decoded_token``, the prompt's own token and the top alternatives.

The router computes a prompt's logprobs once, on the first choice of the prompt (its first
message carries them and the prompt's token ids); the other choices of the prompt share them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from services.router.openai.logprob_columns import LogprobColumns, LogprobEntry


@dataclass(frozen=True, slots=True)
class Echo:
    """What a request asks back of its prompts: ``prompt`` (echo), ``without_generation``
    (echo with max_tokens 0: the one token the cluster samples is dropped), echo's logprobs
    (``num_logprobs`` alternatives, None: none) and the ``prompt_logprobs`` field's."""

    prompt: bool = False
    without_generation: bool = False
    num_logprobs: int | None = None
    num_prompt_logprobs: int | None = None

    @property
    def num_computed(self) -> int | None:
        """The alternatives the workers compute per prompt token (None: no prompt logprobs)."""
        wanted = [n for n in (self.num_logprobs, self.num_prompt_logprobs) if n is not None]
        return max(wanted) if wanted else None


NO_ECHO = Echo()


class PromptRecord:
    """One prompt's token ids and logprob entries (one per token after the first), from its
    first choice's first message."""

    __slots__ = ("entries", "token_ids")

    def __init__(self, token_ids: list[int], entries: LogprobColumns) -> None:
        self.token_ids = token_ids
        self.entries = entries

    def echo_batches(self, num_top: int, size: int) -> Iterator[list[LogprobEntry]]:
        """The entries of the prompt tokens after the first, ``num_top`` alternatives each, in
        lists of ``size``."""
        for start in range(0, len(self.entries), size):
            yield [
                (token_id, logprob, list(tops)[:num_top])
                for token_id, logprob, tops in self.entries.entries(start, start + size)
            ]

    def field_batches(
        self, num_top: int, text: Callable[[int], str], size: int
    ) -> Iterator[list[dict[str, Any] | None]]:
        """vLLM's ``prompt_logprobs`` in lists of about ``size``: null, then per prompt token
        its own entry and the top ``num_top`` alternatives, keyed by token id."""
        yield [None]
        ranks = self.entries.ranks
        for start in range(0, len(self.entries), size):
            batch: list[dict[str, Any] | None] = []
            for position, (token_id, logprob, tops) in enumerate(
                self.entries.entries(start, start + size), start=start
            ):
                entry = {str(token_id): _logprob(logprob, ranks[position], text(token_id))}
                for rank, (top_id, top_logprob) in enumerate(list(tops)[:num_top], start=1):
                    entry.setdefault(str(top_id), _logprob(top_logprob, rank, text(top_id)))
                batch.append(entry)
            yield batch


def _logprob(logprob: float, rank: int, decoded: str) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": decoded}
