"""``Router.Explain``'s answer: a route plan as protobuf."""

from __future__ import annotations

from services.common.convert import field_values
from services.router.prefill_cost import CandidateScore
from services.router.route_plan import PrefillPlace, RoutePlan
from splitserve.v1 import router_pb2


def explain_response(plan: RoutePlan, prompt_tokens: int) -> router_pb2.ExplainResponse:
    """Every candidate of both pools, cheapest first, and where the request would go."""
    response = router_pb2.ExplainResponse(
        prompt_tokens=prompt_tokens,
        prompt_blocks=len(plan.prefill.block_hashes),
        prefill_place=plan.place.value,
    )
    if plan.place is PrefillPlace.PREFILL_WORKER and plan.prefill.worker is not None:
        response.chosen_prefill = plan.prefill.worker.address
    for candidate in sorted(plan.prefill.candidates, key=lambda c: c.score.cost):
        score = candidate.score
        response.prefill.append(
            router_pb2.PrefillCandidateScore(
                address=candidate.worker.address, **field_values(score, CandidateScore)
            )
        )
    for decode in plan.decode_candidates:
        info = decode.worker.info
        response.decode.append(
            router_pb2.DecodeCandidateScore(
                address=decode.worker.address,
                worker_id=info.worker_id if info is not None else "",
                matched_blocks=decode.matched_blocks,
                tier_blocks=plan.prefill.tier_matched.get(info.worker_id, 0) if info else 0,
                active_requests=decode.active_requests,
                kv_usage=decode.worker.load.kv_usage,
                cost=decode.cost,
            )
        )
    if plan.decode is not None:
        response.chosen_decode = plan.decode.worker.address
    if plan.peer_pull is not None:
        response.peer_pull_source = plan.peer_pull.source.address
        response.peer_pull_blocks = plan.peer_pull.num_blocks
    return response
