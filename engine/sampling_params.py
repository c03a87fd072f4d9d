"""Per-request sampling parameters.

Validation happens at construction, so a bad value never reaches the scheduler; every error
names the offending field (services map these ``ValueError``s to gRPC ``INVALID_ARGUMENT``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.constraint import Constraint

MAX_STOP_STRINGS = 16
# A stop string is held back from the stream until it cannot match any more, and checked after
# every token: its length bounds both.
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# Checked for NaN and infinity first: NaN fails no comparison ("nan < 0" is false), and a NaN or
# infinite value turns the sampler's weights into NaN.
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k`` of ``-1`` (or ``0``) disables top-k.
    ``logprobs=None`` returns no logprobs; ``logprobs=N`` returns the chosen token's logprob plus
    the top-``N`` alternatives, all taken from the raw model distribution (before penalties,
    temperature and truncation), as vLLM does; ``prompt_logprobs=N`` the same for each prompt
    token after the first (vLLM's: such a request computes its whole prompt, no prefix-cache
    hit). ``seed`` makes the request's samples reproducible
    regardless of which other requests share its batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # What the output must satisfy (structured output); None: anything.
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the params stay hashable and frozen.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"stop has a string of {longest} characters; at most {MAX_STOP_STRING_CHARS}"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def accepts_drafts(self) -> bool:
        """Whether speculative draft tokens can be checked for this request: greedy with no
        penalty, logprobs or constraint, so each token is the argmax of its logits alone."""
        return (
            self.greedy
            and self.logprobs is None
            and not self.needs_penalties
            and self.constraint is None
        )
