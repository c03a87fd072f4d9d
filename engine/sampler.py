"""Batched next-token sampling with per-row parameters.

Pipeline (vLLM semantics): raw logprobs → repetition penalty (HF: over prompt + output tokens,
positive logits divided, negative multiplied) → presence / frequency penalties (OpenAI: over
output tokens) → greedy rows take the argmax → temperature → min-p → top-k → top-p → sample.

Why nothing sorts the vocabulary: on the 2-core serving CPU a full ``torch.sort`` of a
64 x 49152 batch takes 120-240 ms and ``exponential_`` noise for an exponential race ~55 ms, while
one elementwise pass (``exp``, ``cumsum``) takes 1-3 ms. So:
- Sampling is inverse-CDF: one uniform draw per row against ``cumsum(w)`` of the unnormalized
  weights ``w = exp((logit - max) / T)``, located with ``searchsorted``; min-p is ``w < min_p``.
- top-k rows take ``torch.topk`` candidates (cost grows with k); min-p, top-k and top-p each
  keep a prefix of the sorted candidates, so the nucleus is a cumsum over them.
- top-p rows without top-k use exact rejection sampling on the full row: draw a token and
  accept it if the mass of strictly more probable tokens is < p; otherwise everything not more
  probable than it is outside the nucleus too, so drop that and draw again. A round accepts with
  probability >= p, and a token holding more than 1 - p of the mass is accepted without a pass.
Rows with their own generator draw only from it, one uniform per round, and a row's rounds
depend only on its own logits and draws, so its tokens do not depend on the batch around it.
Ties at a truncation boundary: top-k / top-p on candidates cut by position (as a sort would);
min-p and rejection top-p keep all tokens tied at the boundary.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.sampling_params import SamplingParams
from engine.structured_output import GuidedMatcher, apply_bitmask, bitmask_width

# Block width of the two-level argmax; vocab sizes are usually multiples of 128.
_ARGMAX_BLOCK = 128


@dataclass(slots=True)
class SamplingInput:
    """One row of the batch.

    ``generator`` is the request's own CPU generator (the engine seeds it from ``params.seed``);
    ``None`` draws from the sampler's shared generator.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # The request's output constraint: only the tokens it allows next can be sampled.
    matcher: GuidedMatcher | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprob of the chosen token and the top-N alternatives (best first), all from the raw
    model distribution (log_softmax of the unmodified logits). ``rank`` is 1 + the number of
    tokens with a strictly higher logprob."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One entry per input row, in row order; ``logprobs[i]`` is None unless row i asked.
    ``prompt_logprobs``: per request asking for them, its entries of this step's prompt
    positions (the logprobs of the prompt token each position is followed by)."""

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` for a 2-D tensor (first index among ties, NaN counts as max).

    On CPU ``amax`` is vectorized and ``argmax`` is not, so for vocab-sized rows it is several
    times faster to find the best block of ``_ARGMAX_BLOCK`` columns first.
    """
    num_rows, vocab = x.shape
    num_blocks = vocab // _ARGMAX_BLOCK
    if x.device.type != "cpu" or num_blocks < 2 or vocab % _ARGMAX_BLOCK or not x.is_contiguous():
        return x.argmax(dim=-1)
    blocks = x.view(num_rows, num_blocks, _ARGMAX_BLOCK)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)
    in_block = blocks[torch.arange(num_rows), best_block].argmax(dim=-1)
    return best_block * _ARGMAX_BLOCK + in_block


def is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy, with no logprobs and no penalties: the token is the logits' argmax."""
    return params.greedy and params.logprobs is None and not params.needs_penalties


def _take_rows(x: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
    """The rows ``row_ids`` of ``x``: ``x`` itself when that is all of them, else a copy."""
    return x if len(row_ids) == x.shape[0] else x[row_ids]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _flat_positions(
    token_ids_by_row: Sequence[tuple[int, Sequence[int]]], vocab: int
) -> torch.Tensor:
    """``row * vocab + token_id`` for every (row, token ids) pair, as one int64 tensor."""
    flat = itertools.chain.from_iterable(ids for _, ids in token_ids_by_row)
    token_ids = torch.tensor(list(flat), dtype=torch.long)
    rows = torch.repeat_interleave(
        torch.tensor([row for row, _ in token_ids_by_row]),
        torch.tensor([len(ids) for _, ids in token_ids_by_row]),
    )
    return rows * vocab + token_ids


def _apply_penalties(x: torch.Tensor, rows: Sequence[SamplingInput]) -> None:
    """Apply repetition, then frequency / presence penalties to ``x`` (one row per input) in place.

    Sparse: only the logits of tokens that occur are read and written, so the cost follows the
    number of prompt / output tokens, not the vocab. ``x`` must be contiguous.
    """
    vocab, device = x.shape[1], x.device
    flat_x = x.view(-1)
    repeated = [
        (i, [*r.prompt_token_ids, *r.output_token_ids])
        for i, r in enumerate(rows)
        if r.params.repetition_penalty != 1.0
    ]
    if repeated:
        seen = torch.unique(_flat_positions(repeated, vocab)).to(device)
        penalties = torch.tensor([r.params.repetition_penalty for r in rows], device=device)
        penalty = penalties[seen // vocab]
        values = flat_x[seen]
        flat_x[seen] = torch.where(values > 0, values / penalty, values * penalty)
    additive = [
        (i, r.output_token_ids)
        for i, r in enumerate(rows)
        if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0
    ]
    if additive:
        positions, counts = torch.unique(_flat_positions(additive, vocab), return_counts=True)
        positions, counts = positions.to(device), counts.to(device)
        row = positions // vocab
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[row]
        presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)[row]
        flat_x[positions] = flat_x[positions] - (counts * frequency + presence)


def raw_token_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, nums: list[int]
) -> list[TokenLogprobs]:
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = ((raw_logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_values, top_ids = raw_logprobs.topk(max(nums), dim=-1)
    results = []
    for i, (token_id, logprob, rank) in enumerate(
        zip(token_ids.tolist(), chosen.squeeze(1).tolist(), ranks, strict=True)
    ):
        top = tuple(
            zip(top_ids[i, : nums[i]].tolist(), top_values[i, : nums[i]].tolist(), strict=True)
        )
        results.append(TokenLogprobs(token_id, logprob, rank, top))
    return results


def _mask_constrained(x: torch.Tensor, rows: Sequence[SamplingInput]) -> None:
    """Set to -inf, in place, every logit that a row's constraint forbids next (one bitmask for
    the constrained rows; the others are not touched)."""
    constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
    if not constrained:
        return
    bitmask = torch.empty((len(constrained), bitmask_width(x.shape[1])), dtype=torch.int32)
    for row, i in enumerate(constrained):
        matcher = rows[i].matcher
        assert matcher is not None
        matcher.fill_bitmask(bitmask, row)
    apply_bitmask(x, bitmask, torch.tensor(constrained))


class Sampler:
    """Picks one token per row of a logits batch; stateless apart from the shared generator.

    Side effect: when ``logits`` is float32 it is used as scratch space and overwritten (on the
    all-greedy path only the rows of constrained requests, masked); pass a copy if the caller
    still needs it. Other dtypes are widened to float32 first, except on the all-greedy path
    without constraints: an argmax is the same in the model's dtype, and the widening copy of a
    decode batch's logits cost more than the argmax. Stop conditions are not the sampler's job.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingInput]) -> SamplerOutput:
        """Sample one token per row of ``logits`` ([len(rows), vocab], any float dtype).

        Runs under ``torch.inference_mode`` so in-place work on the model's (inference) logits
        is allowed.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        if all(is_plain_greedy(r.params) for r in rows):
            if any(r.matcher is not None for r in rows):
                x = logits.float().contiguous()
                _mask_constrained(x, rows)
            else:
                x = logits.contiguous()
            return SamplerOutput(argmax_rows(x).tolist(), [None] * len(rows))
        return self._sample(logits.float().contiguous(), rows)

    def _sample(self, x: torch.Tensor, rows: Sequence[SamplingInput]) -> SamplerOutput:
        num_rows = len(rows)
        logprob_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(x[logprob_rows], dim=-1) if logprob_rows else None

        if any(r.params.needs_penalties for r in rows):
            _apply_penalties(x, rows)
        # After the raw logprobs: they report the model's distribution, not the constrained one.
        _mask_constrained(x, rows)

        tokens = torch.empty(num_rows, dtype=torch.long, device=x.device)
        vocab = x.shape[1]
        greedy_rows, top_k_rows, full_rows = [], [], []
        for i, r in enumerate(rows):
            if r.params.greedy:
                greedy_rows.append(i)
            elif 0 < r.params.top_k < vocab:
                top_k_rows.append(i)
            else:
                full_rows.append(i)
        if greedy_rows:
            tokens[greedy_rows] = argmax_rows(_take_rows(x, greedy_rows))
        if top_k_rows:
            tokens[top_k_rows] = self._sample_top_k(
                _take_rows(x, top_k_rows), [rows[i] for i in top_k_rows]
            )
        if full_rows:
            tokens[full_rows] = self._sample_full(
                _take_rows(x, full_rows), [rows[i] for i in full_rows]
            )

        logprobs: list[TokenLogprobs | None] = [None] * num_rows
        if raw_logprobs is not None:
            nums = [rows[i].params.logprobs or 0 for i in logprob_rows]
            for i, lp in zip(
                logprob_rows,
                raw_token_logprobs(raw_logprobs, tokens[logprob_rows], nums),
                strict=True,
            ):
                logprobs[i] = lp
        return SamplerOutput(tokens.tolist(), logprobs)

    def _uniforms(self, rows: Sequence[SamplingInput], device: torch.device) -> torch.Tensor:
        """One U[0, 1) draw per row: from the row's own generator, else from the shared one."""
        draws = torch.empty(len(rows), dtype=torch.float32)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            draws[shared] = torch.rand(len(shared), generator=self._generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                draws[i] = torch.rand(1, generator=r.generator)
        return draws.to(device)

    def _sample_top_k(self, x: torch.Tensor, rows: Sequence[SamplingInput]) -> torch.Tensor:
        """Sample rows with top-k (and maybe min-p / top-p) among their sorted top-k candidates."""
        device = x.device
        params = [r.params for r in rows]
        top_k = torch.tensor([p.top_k for p in params], device=device).unsqueeze(1)
        # The widest k from the host's params: reading it off the device would wait for it.
        values, token_ids = x.topk(max(p.top_k for p in params), dim=-1)
        temperature = _column([p.temperature for p in params], device)
        weights = ((values - values[:, :1]) / temperature).exp_()
        dropped = torch.arange(values.shape[1], device=device) >= top_k
        if any(p.min_p > 0.0 for p in params):
            dropped |= weights < _column([p.min_p for p in params], device)
        weights.masked_fill_(dropped, 0.0)
        cum = weights.cumsum(dim=-1)
        # top-p keeps candidate j while the mass before it is < p (so always the first one).
        top_p = _column([p.top_p for p in params], device)
        mass_before = F.pad(cum[:, :-1], (1, 0))
        num_kept = (mass_before < top_p * cum[:, -1:]).sum(dim=-1, keepdim=True)
        target = self._uniforms(rows, device).unsqueeze(1) * cum.gather(1, num_kept - 1)
        pos = torch.searchsorted(cum, target, right=True).clamp_max_(num_kept - 1)
        return token_ids.gather(1, pos).squeeze(1)

    def _sample_full(self, x: torch.Tensor, rows: Sequence[SamplingInput]) -> torch.Tensor:
        """Sample rows without top-k over the whole vocab, top-p by rejection. Overwrites x."""
        device = x.device
        params = [r.params for r in rows]
        weights = x.sub_(x.amax(dim=-1, keepdim=True))
        weights.div_(_column([p.temperature for p in params], device)).exp_()
        if any(p.min_p > 0.0 for p in params):
            weights.masked_fill_(weights < _column([p.min_p for p in params], device), 0.0)
        tokens = torch.empty(len(rows), dtype=torch.long, device=device)
        active = list(range(len(rows)))  # rows of `params` still drawing; one per weights row
        nucleus_mass: torch.Tensor | None = None
        while True:
            cum = weights.cumsum(dim=-1)
            total = cum[:, -1:].contiguous()
            if nucleus_mass is None:
                nucleus_mass = _column([p.top_p for p in params], device) * total
            target = self._uniforms([rows[i] for i in active], device).unsqueeze(1) * total
            # u * total can round up to total: clamp to the last token with weight.
            pos = torch.minimum(
                torch.searchsorted(cum, target, right=True), torch.searchsorted(cum, total)
            )
            picked = weights.gather(1, pos)
            # A token holding more than 1 - p of the mass is in the nucleus whatever lies above.
            sure = (picked + nucleus_mass > total).squeeze(1).tolist()
            undecided = [j for j, i in enumerate(active) if params[i].top_p < 1.0 and not sure[j]]
            retry: list[int] = []
            if undecided:
                # Mass of strictly more probable tokens: sum(relu(w - w_picked)) + w_picked * count.
                excess = (_take_rows(weights, undecided) - picked[undecided]).clamp_min_(0.0)
                mass_above = excess.sum(dim=-1, keepdim=True)
                mass_above += picked[undecided] * excess.sign_().sum(dim=-1, keepdim=True)
                outside = (mass_above >= nucleus_mass[undecided]).squeeze(1).tolist()
                retry = [j for j, out in zip(undecided, outside, strict=True) if out]
            rejected = set(retry)
            done = [j for j in range(len(active)) if j not in rejected]
            tokens[[active[j] for j in done]] = pos[done, 0]
            if not retry:
                return tokens
            # Everything not more probable than a rejected token is outside the nucleus too.
            retry_weights = weights[retry]
            weights = retry_weights * (retry_weights > picked[retry])
            nucleus_mass = nucleus_mass[retry]
            active = [active[j] for j in retry]
