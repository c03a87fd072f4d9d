"""What a request's output must satisfy: a JSON schema, any JSON object, a regex, one of a list
of choices, or a Lark grammar, as one llguidance grammar.

Torch-free (the router validates constraints with it before any worker is involved): llguidance
is a Rust library whose wheel has no dependency. The engine side (matchers, bitmasks) is
``engine.structured_output``.
"""

from __future__ import annotations

import enum
import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# The constraints whose grammar is kept for reuse (a string each).
_GRAMMAR_CACHE_SIZE = 1024
# JSON on one line as json.dumps writes it: free whitespace lets a model pad forever (small
# models do), never closing the value. A schema's "x-guidance" options override this.
_JSON_LAYOUT: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"  # Lark syntax (llguidance's)


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's output constraint. ``spec`` is the JSON schema text, the regex or the Lark
    grammar (empty for ``JSON_OBJECT``); ``choices`` the allowed outputs for ``CHOICE``."""

    kind: ConstraintKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind is ConstraintKind.CHOICE and not self.choices:
            raise ValueError("a choice constraint needs at least one choice")

    def grammar(self) -> str:
        """The constraint as an llguidance grammar (not yet checked; see ``validate``)."""
        return _grammar(self)

    def validate(self) -> None:
        """Raise ``ValueError`` naming what is wrong (bad JSON, schema, regex or grammar)."""
        try:
            grammar = self.grammar()
        except ValueError as exc:
            raise ValueError(f"{self.kind.value}: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"{self.kind.value}: {error}")


@functools.lru_cache(maxsize=_GRAMMAR_CACHE_SIZE)
def _grammar(constraint: Constraint) -> str:
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        schema = json.loads(constraint.spec)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_LAYOUT)
    if kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_JSON_LAYOUT
        )
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
    if kind is ConstraintKind.CHOICE:
        alternatives = " | ".join(json.dumps(choice) for choice in constraint.choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.LLMatcher.grammar_from_lark(constraint.spec)
