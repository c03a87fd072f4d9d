"""What the scheduler hands the engine each step: the requests' shares of the step, and the
requests whose KV must arrive from elsewhere before they run."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: compute tokens [num_computed_tokens, + num_new_tokens).

    With ``spec_token_ids`` (a decode's drafts) the last ``len(spec_token_ids)`` of those
    tokens are the drafts, which follow the request's real tokens.
    """

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    spec_token_ids: tuple[int, ...] = ()
    # One real token (plus drafts, if any): the decode attention path computes it.
    is_decode: bool = field(init=False)
    # Logits rows this item produces: one per draft plus one if this step's logits give the
    # request's next token (it reaches the request's last token), else none. Fixed when the
    # item is made, before ``update_from_output`` advances the request.
    num_sample_rows: int = field(init=False)
    # Positions whose logits give prompt logprobs (the next prompt token's), after the sample
    # rows in the step's logits: a prompt_logprobs request's prompt positions this step
    # computes for the first time, its last prompt token's excepted (that one samples).
    prompt_logprob_positions: range = field(init=False)

    def __post_init__(self) -> None:
        num_real_tokens = self.num_new_tokens - len(self.spec_token_ids)
        request = self.request
        start = request.num_computed_tokens
        samples = start + num_real_tokens == request.num_tokens
        object.__setattr__(self, "is_decode", num_real_tokens == 1)
        object.__setattr__(self, "num_sample_rows", 1 + len(self.spec_token_ids) if samples else 0)
        positions = range(0)
        if request.sampling_params.prompt_logprobs is not None:
            first = max(start, request.num_prompt_logprob_positions)
            stop = min(start + num_real_tokens, request.num_prompt_tokens - 1)
            positions = range(first, max(first, stop))
        object.__setattr__(self, "prompt_logprob_positions", positions)

    @property
    def token_ids(self) -> list[int]:
        """The ids of the tokens this step computes, drafts last."""
        start = self.request.num_computed_tokens
        num_real_tokens = self.num_new_tokens - len(self.spec_token_ids)
        return self.request.all_token_ids[start : start + num_real_tokens] + list(
            self.spec_token_ids
        )


@dataclass(frozen=True, slots=True)
class KVLoad:
    """A request whose first ``num_external_tokens`` tokens' KV must arrive from elsewhere.

    The first ``num_local_hit_tokens`` are already here (own prefix cache); blocks from
    ``block_ids[num_local_hit_tokens // block_size:]`` must be filled by the transfer.
    """

    req_id: str
    block_ids: list[int]
    num_local_hit_tokens: int
    num_external_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes. Invariant: every decode item (``is_decode``) precedes every
    prefill chunk."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
