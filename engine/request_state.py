"""What the engine keeps of a request beside the scheduler: its detokenizer, logprobs and
report position, and how it turns them into ``RequestOutput``s."""

from __future__ import annotations

from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampler import TokenLogprobs


@dataclass(slots=True)
class RequestState:
    """Engine-side bookkeeping of one live request that the scheduler does not need.
    Invariant: ``num_reported_tokens`` output tokens were handed out already."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[TokenLogprobs] | None
    first_token_time_s: float | None = None
    num_reported_tokens: int = 0
    # Prompt logprobs computed so far; handed out with the first token, then None.
    prompt_logprobs: list[TokenLogprobs] | None = None

    def detokenize(self, finished: bool) -> str | None:
        """Feed the request's tokens of this step to its detokenizer, one at a time; return the
        stop string that matched, else None.

        Like vLLM, the eos / stop token that ended a request adds no text. On a stop string the
        output is cut after the token that completed it: tokens a step accepted past it (drafts)
        are dropped, as if generation had stopped there.
        """
        request = self.request
        if self.detokenizer is None:
            return None
        new_ids = request.output_token_ids[self.num_reported_tokens :]
        if finished and isinstance(request.stop_reason, int):
            new_ids = new_ids[:-1]
        for i, token_id in enumerate(new_ids):
            stop = self.detokenizer.update([token_id])
            if stop is not None:
                num_dropped = request.num_output_tokens - self.num_reported_tokens - i - 1
                if num_dropped:
                    del request.output_token_ids[-num_dropped:]
                    del request.all_token_ids[-num_dropped:]
                    if finished:  # by a token the stop string came before
                        request.status = RequestStatus.FINISHED_STOPPED
                        request.stop_reason = stop
                return stop
        return None

    def output(self, new_token_ids: list[int]) -> RequestOutput:
        """The request's output for this step, with ``new_token_ids``; everything it reports
        counts as handed out (its text delta, its prompt logprobs)."""
        request = self.request
        finished = request.status.is_finished
        self.num_reported_tokens = request.num_output_tokens
        detokenizer = self.detokenizer
        # take_delta flushes the tail when finished.
        delta_text = detokenizer.take_delta(finished) if detokenizer is not None else ""
        logprobs = self.logprobs
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        new_logprobs = None
        if logprobs is not None:
            new_logprobs = logprobs[len(logprobs) - len(new_token_ids) :] if new_token_ids else []
        return RequestOutput(
            req_id=request.req_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids) if finished else [],
            new_token_ids=new_token_ids,
            text=detokenizer.output_text if finished and detokenizer is not None else "",
            delta_text=delta_text,
            finished=finished,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_tier_tokens=request.num_tier_tokens,
            logprobs=list(logprobs) if finished and logprobs is not None else None,
            arrival_time_s=request.arrival_time_s,
            first_token_time_s=self.first_token_time_s,
            scheduled_time_s=request.scheduled_time_s,
            new_logprobs=new_logprobs,
            error=request.error,
            prompt_logprobs=prompt_logprobs,
        )
