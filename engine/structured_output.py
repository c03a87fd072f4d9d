"""Structured output: a ``Constraint`` (``engine.constraint``) that every sampled token must keep
satisfiable, enforced with a token bitmask on the logits.

Built on llguidance: its Earley parser over a lazily built token trie needs no per-schema
precompilation pass, and its wheel has no dependency (the router validates constraints with it
and never imports torch). The parts:

- ``GrammarCompiler``: one per engine; holds the tokenizer in llguidance's form (built on the
  first compile: 0.8 s for a 128k vocabulary); ``compile`` turns a constraint into a
  ``CompiledGrammar``: the slow part, run off the engine thread (``engine.grammar_pool``).
- ``CompiledGrammar``: a constraint ready to start; ``matcher`` starts a request's
  ``GuidedMatcher`` (a copy, microseconds) and advances it over the tokens the request already
  has, which is how a decode worker or a migration target picks up the constraint exactly
  where the previous sampler left it (a request preempted by recompute keeps its matcher: its
  tokens stay).
- ``GuidedMatcher``: a request's parser state; ``fill_bitmask`` writes the tokens allowed next
  into one row of a batch bitmask, ``accept`` advances over a sampled token.
- ``apply_bitmask``: masks the constrained rows of a batch's logits in one vectorized step
  (unconstrained rows are not touched).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

import llguidance
import torch

from engine.constraint import Constraint, readable_error

_BITS = 32


class GuidedMatcher:
    """One request's position in its constraint. Not thread-safe (the engine thread's)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write into ``bitmask[row]`` (int32, one bit per token id) the tokens allowed next."""
        view = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False if the constraint forbids it (the matcher is then
        in its error state for good)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The constraint is complete: nothing but an end of sequence may follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class CompiledGrammar:
    """A constraint compiled for one tokenizer: a matcher at its start, never advanced itself
    (each request gets a copy). Thread-safe: ``matcher`` only reads it."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def matcher(self, token_ids: Sequence[int] = ()) -> GuidedMatcher:
        """A request's matcher advanced over ``token_ids`` (the tokens it already generated);
        ``ValueError`` if they break the constraint. Cheap: a copy and the tokens' steps."""
        matcher = self._matcher.deep_copy()
        if token_ids and not matcher.consume_tokens(list(token_ids)):
            raise ValueError(f"the tokens so far break the constraint: {matcher.get_error()}")
        return GuidedMatcher(matcher)


class GrammarCompiler:
    """The constraints of one model's tokenizer: ``tokenizer_json`` is its ``tokenizer.json``
    text, ``vocab_size`` the model's logits width (at least the tokenizer's). Thread-safe."""

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_token_ids: Collection[int]
    ) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_json = tokenizer_json
        self._eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """``constraint`` ready to start; ``ValueError`` prefixed by its kind (as
        ``Constraint.validate``) if it does not compile. Slow: from a millisecond to seconds
        (``ConstraintLimits``), with the GIL released for most of it."""
        try:
            grammar = constraint.grammar()
        except ValueError as exc:
            raise ValueError(f"{constraint.kind.value}: {exc}") from None
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{constraint.kind.value}: {readable_error(matcher.get_error())}")
        return CompiledGrammar(matcher)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos_token_ids
                )
            return self._tokenizer

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A bitmask of ``num_rows`` rows, every token allowed."""
        return torch.full((num_rows, bitmask_width(self.vocab_size)), -1, dtype=torch.int32)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id."""
    return -(-vocab_size // _BITS)


_SHIFTS = torch.arange(_BITS, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of ``rows`` (indices into ``logits``) whose token's
    bit is clear in the matching row of ``bitmask`` (one bitmask row per index of ``rows``)."""
    vocab_size = logits.shape[-1]
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(bitmask.shape[0], -1)
    blocked = allowed[:, :vocab_size] == 0
    logits[rows] = logits[rows].masked_fill(blocked.to(logits.device), float("-inf"))
