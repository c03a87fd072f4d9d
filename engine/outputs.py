"""What the engine reports about a request after each step."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampler import TokenLogprobs


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's state after a step.

    ``new_token_ids`` / ``new_logprobs`` / ``delta_text`` are what this step added (for
    streaming). The cumulative ``token_ids`` / ``logprobs`` / ``text`` are filled on the
    finished output only (empty / None before): a stream that is read late holds deltas, not
    one copy of everything so far per step. ``delta_text`` never contains text that a stop
    string could still retract. Times are ``time.perf_counter()`` stamps.
    """

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    delta_text: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None
    arrival_time_s: float
    first_token_time_s: float | None
    # When the scheduler first gave it blocks (the end of its queue wait); None while queued.
    scheduled_time_s: float | None = None
    # Of num_cached_tokens, those loaded back from the engine's second tier.
    num_tier_tokens: int = 0
    # One per new token when logprobs were asked for (None otherwise).
    new_logprobs: list[TokenLogprobs] | None = None
    # Set when finish_reason is "error": why this request (only) failed.
    error: str | None = None
    # With prompt_logprobs: one entry per prompt token after the first (the logprob of token
    # i + 1 after the first i + 1), on the output that carries the first new token only.
    prompt_logprobs: list[TokenLogprobs] | None = None
