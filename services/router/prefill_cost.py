"""The prefill cost and the bounded-load pick: the reference that the Redis script mirrors.

For each candidate prefill worker (Dynamo-style cost in blocks; docs/architecture.md#prefill-cost)::

    queued_blocks = max(reported_queued_blocks, reserved_blocks)
    uncached = prompt_blocks - matched_blocks + tier_blocks * tier_load_cost
    cost = cache_weight * uncached + load_weight * queued_blocks

``reported_queued_blocks`` is the worker's last polled prefill queue; ``reserved_blocks`` is the
uncached work every router has reserved on it and not yet seen finish. Taking the larger one
counts a request once whether or not the worker's report already includes it. Of the
``matched_blocks`` the worker holds, ``tier_blocks`` are in its second tier alone: a hit loads
them, at ``tier_load_cost`` blocks of compute each (the worker's measured load time over its
measured compute time; a few hundredths on CPUs, BENCHMARKS.md), so a worker holding a prefix in
its cache wins over one holding it in its tier, and either over one computing it.

Bounded load (consistent hashing with bounded loads, Mirrokni et al.): with ``R`` prefill
requests reserved over ``n`` candidates, a worker may take one more only while its own count
stays within ``max(ceil(load_bound * (R + 1) / n), load_bound_slack)``. A hot prefix therefore
spills onto a second worker (which then caches it too) instead of queueing on one. The slack
keeps a lightly loaded cluster from spreading a prefix for nothing: with fewer requests in
flight than workers, the bound alone would allow one per worker and turn every second request
of a prefix into a miss. At least one worker is always eligible, since the least-reserved one
holds at most ``R / n``.

Among eligible workers the cheapest wins; ties go to ``tied[floor(tie_value * len(tied))]``,
so a seeded ``tie_value`` makes the choice reproducible. When ``saturation_blocks`` is set and
every candidate has at least that much queued, nothing is chosen: the caller prefills on the
decode worker instead (conditional disaggregation).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefillWeights:
    """The policy's knobs (router flags of the same names)."""

    cache_weight: float = 1.0
    load_weight: float = 0.5
    load_bound: float = 0.0  # 0: no bound
    load_bound_slack: int = 0  # requests a worker may always have in flight, whatever the bound
    saturation_blocks: float = 0.0  # 0: never saturated


@dataclass(frozen=True, slots=True)
class CandidateScore:
    """One candidate as scored for one prompt."""

    worker_id: str
    matched_blocks: int
    tier_blocks: int  # of matched_blocks, those in the worker's tier alone
    reserved_blocks: int
    reserved_requests: int
    queued_blocks: float
    eligible: bool
    cost: float


@dataclass(frozen=True, slots=True)
class CandidateLoad:
    """What the router knows of one healthy prefill worker before asking the index."""

    worker_id: str
    reported_queued_blocks: float
    # Blocks of compute that loading one block from its tier costs (0: no tier, or unmeasured).
    tier_load_cost: float = 0.0


def score_candidates(
    prompt_blocks: int,
    candidates: Sequence[CandidateLoad],
    matched: dict[str, int],
    reserved_blocks: Sequence[int],
    reserved_requests: Sequence[int],
    weights: PrefillWeights,
    tier_matched: Mapping[str, int] | None = None,
) -> tuple[CandidateScore, ...]:
    """Score every candidate (``reserved_*`` are per candidate, in order). ``tier_matched``:
    worker id -> how many of its matched blocks are in its tier alone (absent: none)."""
    tier_matched = tier_matched or {}
    total_requests = sum(reserved_requests)
    capacity = (
        max(
            math.ceil(weights.load_bound * (total_requests + 1) / len(candidates)),
            weights.load_bound_slack,
        )
        if weights.load_bound > 0 and candidates
        else math.inf
    )
    scores = []
    for candidate, blocks, requests in zip(
        candidates, reserved_blocks, reserved_requests, strict=True
    ):
        matched_blocks = min(matched.get(candidate.worker_id, 0), prompt_blocks)
        tier_blocks = min(tier_matched.get(candidate.worker_id, 0), matched_blocks)
        queued_blocks = max(candidate.reported_queued_blocks, float(blocks))
        uncached = prompt_blocks - matched_blocks + tier_blocks * candidate.tier_load_cost
        cost = weights.cache_weight * uncached + weights.load_weight * queued_blocks
        scores.append(
            CandidateScore(
                candidate.worker_id,
                matched_blocks,
                tier_blocks,
                blocks,
                requests,
                queued_blocks,
                requests + 1 <= capacity,
                cost,
            )
        )
    return tuple(scores)


def pick(scores: Sequence[CandidateScore], weights: PrefillWeights, tie_value: float) -> int | None:
    """Index of the chosen candidate; None when there is none or every one is saturated."""
    if not scores:
        return None
    if weights.saturation_blocks > 0 and all(
        s.queued_blocks >= weights.saturation_blocks for s in scores
    ):
        return None
    eligible = [i for i, s in enumerate(scores) if s.eligible]
    best = min(scores[i].cost for i in eligible)
    tied = [i for i in eligible if scores[i].cost == best]
    return tied[min(int(tie_value * len(tied)), len(tied) - 1)]
