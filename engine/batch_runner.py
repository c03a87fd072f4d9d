"""One step's forward pass and sampling, with failures confined to the requests that cause them.

A request can fail on its own: its logits are not finite (a NaN that slipped through, an
overflow), or the model or sampler raises on its tokens. Such a request is left out of the
step's samples and reported with its error; the batch goes on. A fault of the engine itself (a
broken device, a kernel bug hit by every batch) makes every request fail and is raised as
``EngineBrokenError``, which takes the engine down so that its supervisor replaces the process.
"""

from __future__ import annotations

import logging

import torch

from engine.model_runner import ModelRunner
from engine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingInput,
    TokenLogprobs,
    argmax_rows,
    is_plain_greedy,
    raw_token_logprobs,
)
from engine.scheduler_output import ScheduledRequest

logger = logging.getLogger(__name__)

# Steps of one request each that may fail in a row before the engine counts as broken (a
# request's own fault fails one step; a broken device or model fails every one).
_MAX_FAILED_STEPS_IN_A_ROW = 3
NON_FINITE_LOGITS = "the model produced non-finite logits (NaN or infinity)"


class EngineBrokenError(RuntimeError):
    """The engine cannot run any request (every recent step failed whatever it held)."""


class BatchRunner:
    """Runs ``runner`` + ``sampler`` over a scheduled batch (engine thread only)."""

    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        self.runner = runner
        self.sampler = sampler
        self._num_failed_steps_in_a_row = 0

    def run(self, scheduled: list[ScheduledRequest]) -> tuple[SamplerOutput, dict[str, str]]:
        """Forward and sample ``scheduled``; return the samples of the requests that did not
        fail (in order) and the error of each that did.

        When the batch raises, every request is run alone (the forward pass is a function of
        the scheduled tokens and the cache, so recomputing rewrites the same KV): those that
        still raise failed on their own. Raises ``EngineBrokenError`` when nothing runs.
        """
        try:
            sampled, errors = self._forward_and_sample(scheduled)
        except Exception as exc:  # isolated below, or EngineBrokenError
            if len(scheduled) == 1:
                self._note_isolated_failure(exc)
                return SamplerOutput([], []), {scheduled[0].request.req_id: repr(exc)}
            logger.exception("a step of %d requests failed; running each alone", len(scheduled))
            return self._run_one_by_one(scheduled)
        self._num_failed_steps_in_a_row = 0
        return sampled, errors

    def _run_one_by_one(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[SamplerOutput, dict[str, str]]:
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        errors: dict[str, str] = {}
        last_error: Exception | None = None
        for item in scheduled:
            try:
                one, one_errors = self._forward_and_sample([item])
            except Exception as exc:  # this request's own failure
                last_error = exc
                errors[item.request.req_id] = repr(exc)
                continue
            errors.update(one_errors)
            tokens.extend(one.sampled_token_ids)
            logprobs.extend(one.logprobs)
            prompt_logprobs.update(one.prompt_logprobs)
        if last_error is not None and len(errors) == len(scheduled):
            raise EngineBrokenError(f"every request of the step fails: {last_error!r}")
        self._num_failed_steps_in_a_row = 0
        return SamplerOutput(tokens, logprobs, prompt_logprobs), errors

    def _note_isolated_failure(self, exc: Exception) -> None:
        """A step of one request failed: its fault, unless steps keep failing whatever runs."""
        self._num_failed_steps_in_a_row += 1
        if self._num_failed_steps_in_a_row >= _MAX_FAILED_STEPS_IN_A_ROW:
            raise EngineBrokenError(
                f"{self._num_failed_steps_in_a_row} steps in a row failed: {exc!r}"
            ) from exc
        logger.exception("a step of one request failed; failing that request")

    def _forward_and_sample(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[SamplerOutput, dict[str, str]]:
        """One forward pass and sampling; rows whose logits are not finite are left out of the
        samples and returned as errors."""
        logits = self.runner.execute(scheduled)
        # One row per sample: an item with drafts has several (``num_sample_rows``).
        sampling = [s for s in scheduled for _ in range(s.num_sample_rows)]
        prompt_logprobs = _prompt_logprobs(logits[len(sampling) :], scheduled)
        logits = logits[: len(sampling)]
        sampled, errors = self._sample(logits, sampling, scheduled)
        if prompt_logprobs:
            sampled = SamplerOutput(sampled.sampled_token_ids, sampled.logprobs, prompt_logprobs)
        return sampled, errors

    def _sample(
        self,
        logits: torch.Tensor,
        sampling: list[ScheduledRequest],
        scheduled: list[ScheduledRequest],
    ) -> tuple[SamplerOutput, dict[str, str]]:
        """The samples of ``sampling``'s rows (``logits``, one row each)."""
        if sampling and all(_plain_greedy(s) for s in scheduled):
            return _greedy_ids(logits, sampling)
        errors: dict[str, str] = {}
        if sampling:
            finite = torch.isfinite(logits.amax(dim=-1)).tolist()
            if not all(finite):
                errors = {
                    s.request.req_id: NON_FINITE_LOGITS
                    for s, ok in zip(sampling, finite, strict=True)
                    if not ok
                }
                keep = [i for i, s in enumerate(sampling) if s.request.req_id not in errors]
                logits = logits[keep]
                sampling = [sampling[i] for i in keep]
        rows = [
            SamplingInput(
                params=s.request.sampling_params,
                generator=s.request.next_token_generator(),
                prompt_token_ids=s.request.prompt_token_ids,
                output_token_ids=s.request.output_token_ids,
                matcher=s.request.matcher,
            )
            for s in sampling
        ]
        return self.sampler(logits, rows), errors


def _prompt_logprobs(
    logits: torch.Tensor, scheduled: list[ScheduledRequest]
) -> dict[str, list[TokenLogprobs]]:
    """Each item's prompt logprobs from its ``prompt_logprob_positions`` rows (``logits``, in
    scheduled order): the logprob of the prompt token that follows each position, its rank,
    and the top ``prompt_logprobs`` alternatives, from the raw distribution in float32."""
    if not len(logits):
        return {}
    targets: list[int] = []
    nums: list[int] = []
    for item in scheduled:
        request = item.request
        num = request.sampling_params.prompt_logprobs or 0
        for position in item.prompt_logprob_positions:
            targets.append(request.prompt_token_ids[position + 1])
            nums.append(num)
    raw = torch.log_softmax(logits.float(), dim=-1)
    entries = raw_token_logprobs(raw, torch.tensor(targets, device=raw.device), nums)
    result: dict[str, list[TokenLogprobs]] = {}
    start = 0
    for item in scheduled:
        count = len(item.prompt_logprob_positions)
        if count:
            result[item.request.req_id] = entries[start : start + count]
            start += count
    return result


def _plain_greedy(item: ScheduledRequest) -> bool:
    """Whether the request's next token is its logits' argmax and nothing else is asked of
    them (no logprobs, penalties or output constraint)."""
    request = item.request
    return request.matcher is None and is_plain_greedy(request.sampling_params)


def _greedy_ids(
    logits: torch.Tensor, sampling: list[ScheduledRequest]
) -> tuple[SamplerOutput, dict[str, str]]:
    """The argmax of every row, with the rows whose logits are not finite as errors: one
    reduction over the logits and one copy of the ids to the host (on a GPU, the step's only
    wait for the device). Ties go to the first maximum, as in the sampler.
    """
    if logits.device.type == "cpu":  # two vectorized passes beat one ``max`` there
        best, ids = logits.amax(dim=-1), argmax_rows(logits)
    else:
        best, ids = logits.max(dim=-1)
    rows = torch.where(torch.isfinite(best), ids, -1).tolist()
    errors = {
        s.request.req_id: NON_FINITE_LOGITS for s, t in zip(sampling, rows, strict=True) if t < 0
    }
    tokens = [t for s, t in zip(sampling, rows, strict=True) if s.request.req_id not in errors]
    return SamplerOutput(tokens, [None] * len(tokens)), errors
