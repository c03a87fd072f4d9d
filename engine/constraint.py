"""What a request's output must satisfy: a JSON schema, any JSON object, a regex, one of a list
of choices, or a Lark grammar, as one llguidance grammar; and the budget every constraint must
fit (``ConstraintLimits``).

Torch-free (the router validates constraints with it before any worker is involved): llguidance
is a Rust library whose wheel has no dependency. The engine side (matchers, bitmasks) is
``engine.structured_output``; compiling off the caller's thread, ``engine.grammar_pool``.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON on one line as json.dumps writes it: free whitespace lets a model pad forever (small
# models do), never closing the value. A schema's "x-guidance" options override this.
_JSON_LAYOUT: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}
# llguidance asserts ``grammar.symbols.len() < u16::MAX - 10`` while it builds a matcher (a
# panic, reported as the matcher's error): about one symbol per distinct literal and rule,
# so a list of some 65,500 choices is past it.
MAX_GRAMMAR_SYMBOLS = 65_524
_PANICS = {
    "grammar.symbols.len() < u16::MAX": (
        f"the grammar has more than {MAX_GRAMMAR_SYMBOLS} symbols (literals and rules), "
        "llguidance's limit"
    ),
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

    @property
    def num_bytes(self) -> int:
        """The size of what the client wrote: the spec's UTF-8 bytes, or all the choices'."""
        if self.kind is ConstraintKind.CHOICE:
            return sum(len(choice.encode()) for choice in self.choices)
        return len(self.spec.encode())

    def grammar(self) -> str:
        """The constraint as an llguidance grammar (not yet checked; see ``validate``); slow
        for a large constraint (see ``ConstraintLimits``). ``ValueError`` on bad JSON."""
        kind = self.kind
        if kind is ConstraintKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.spec)
            except RecursionError:
                raise ValueError("the schema is nested too deeply") from None
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_LAYOUT)
        if kind is ConstraintKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=_JSON_LAYOUT
            )
        if kind is ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if kind is ConstraintKind.CHOICE:
            alternatives = " | ".join(json.dumps(choice) for choice in self.choices)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.LLMatcher.grammar_from_lark(self.spec)

    def validate(self) -> None:
        """Raise ``ValueError`` naming what is wrong (bad JSON, schema, regex or grammar),
        prefixed by the kind (``"regex: ..."``). Slow for a large constraint: the router runs
        it within a budget (``engine.grammar_pool``). Some limits only show when a matcher is
        built with the model's tokenizer (``MAX_GRAMMAR_SYMBOLS``): the worker reports those."""
        try:
            grammar = self.grammar()
        except ValueError as exc:
            raise ValueError(f"{self.kind.value}: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"{self.kind.value}: {readable_error(error)}")


@dataclass(frozen=True, slots=True)
class ConstraintLimits:
    """The budget of one constraint, the same at the router (which refuses what is over it)
    and on the workers (which compile it): its size, checked before any compiling, and how
    long its compile may take.

    The sizes bound the compile time, which grows faster than the size: on a 2-core host with a
    128k-token vocabulary, a schema of 3,000 properties (64 KiB) builds its matcher in 1.1 s,
    one of 6,000 (128 KiB) in 5.5 s, 10,000 choices in 0.6 s; with a tiny vocabulary 100,000
    choices took 15 s before llguidance gave up (``MAX_GRAMMAR_SYMBOLS``). Validation without
    the tokenizer (the router's) takes a fifth to a half of that. A compile past
    ``compile_timeout_s`` fails its request; its thread still runs to the end (threads cannot
    be stopped), but llguidance builds with the GIL released, so it costs a core, not the
    engine's steps.
    """

    max_bytes: int = 64 * 1024
    max_choices: int = 10_000
    compile_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_choices < 1 or self.compile_timeout_s <= 0:
            raise ValueError(f"constraint limits must be positive, got {self}")

    def check(self, constraint: Constraint) -> None:
        """Raise ``ValueError`` (prefixed by the kind, as ``Constraint.validate``) when
        ``constraint`` is over the size budget. Cheap: nothing is compiled."""
        kind = constraint.kind.value
        num_choices = len(constraint.choices)
        if num_choices > self.max_choices:
            raise ValueError(f"{kind}: {num_choices} choices, more than {self.max_choices}")
        num_bytes = constraint.num_bytes
        if num_bytes > self.max_bytes:
            raise ValueError(f"{kind}: {num_bytes} bytes, more than {self.max_bytes}")


def readable_error(error: str) -> str:
    """llguidance's error text as a sentence: a panic as the limit it asserts (or its first
    line), never the backtrace that follows it."""
    text = error.split("<backtrace>", 1)[0].strip()
    if not text.startswith("panic:"):
        return text
    for assertion, sentence in _PANICS.items():
        if assertion in text:
            return sentence
    reason = text.removeprefix("panic:").strip().splitlines()[0]
    return f"llguidance cannot build it ({reason})"
