"""splitserve's request vocabulary to vLLM's and back: sampling parameters, constraints and
logprobs. vLLM is imported inside the functions (it is an optional dependency)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.constraint import Constraint, ConstraintKind
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import vllm
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors


def structured_outputs(constraint: Constraint) -> StructuredOutputsParams:
    """``constraint`` as vLLM's structured outputs, compiled by the backend vLLM picks (its
    ``--structured-outputs-config``, through ``--vllm-args``)."""
    from vllm.sampling_params import StructuredOutputsParams

    match constraint.kind:
        case ConstraintKind.JSON_SCHEMA:
            return StructuredOutputsParams(json=constraint.spec)
        case ConstraintKind.JSON_OBJECT:
            return StructuredOutputsParams(json_object=True)
        case ConstraintKind.REGEX:
            return StructuredOutputsParams(regex=constraint.spec)
        case ConstraintKind.CHOICE:
            return StructuredOutputsParams(choice=list(constraint.choices))
        case ConstraintKind.GRAMMAR:
            return StructuredOutputsParams(grammar=constraint.spec)


def sampling_params(params: SamplingParams, num_given_tokens: int) -> vllm.SamplingParams:
    """vLLM's parameters for a request that already has ``num_given_tokens`` output tokens.

    Token ids only: splitserve's router detokenizes and matches stop strings, so vLLM does
    neither (``detokenize=False``, no ``stop``). Outputs are deltas, as the workers stream them.
    """
    import vllm
    from vllm.sampling_params import RequestOutputKind

    return vllm.SamplingParams(
        max_tokens=params.max_tokens - num_given_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=max(params.top_k, 0),
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        skip_special_tokens=params.skip_special_tokens,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=(
            None if params.constraint is None else structured_outputs(params.constraint)
        ),
    )


def token_logprobs(lists: LogprobsLists) -> list[TokenLogprobs]:
    """One ``TokenLogprobs`` per row of vLLM's logprobs: column 0 is the sampled token, the
    rest the top alternatives, best first (vLLM's default ``raw_logprobs`` mode: the model's
    distribution before any processing, as the native engine reports)."""
    return _rows(
        lists.logprob_token_ids.tolist(),
        lists.logprobs.tolist(),
        lists.sampled_token_ranks.tolist(),
    )


def prompt_token_logprobs(tensors: LogprobsTensors) -> list[TokenLogprobs]:
    """One ``TokenLogprobs`` per prompt position of a prefill chunk (vLLM's prompt logprobs:
    column 0 is the next prompt token, the rest the top alternatives, best first)."""
    return _rows(
        tensors.logprob_token_ids.tolist(),
        tensors.logprobs.tolist(),
        tensors.selected_token_ranks.tolist(),
    )


def _rows(ids: list[list[int]], values: list[list[float]], ranks: list[int]) -> list[TokenLogprobs]:
    rows = []
    for row_ids, row_values, rank in zip(ids, values, ranks, strict=True):
        top = tuple(zip(row_ids[1:], row_values[1:], strict=True))
        rows.append(TokenLogprobs(row_ids[0], row_values[0], int(rank), top))
    return rows
