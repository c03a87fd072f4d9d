"""The router's part of a request's trace: the request, its routing decision, its worker calls.

``generate`` (SERVER) is the request from the router's view, a child of the client's
``traceparent`` or a new root; under it ``route`` (the candidates' scores, the choice, the
ledger's time, which is the Redis round trip with a Redis index), then one CLIENT span per
worker call (``prefill_call``, one ``decode_call`` per decode worker tried), whose context the
call carries to the worker. A prefill fallback and a decode failover are events of ``generate``.
Attribute names follow vLLM's ``gen_ai.*`` where it has one.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import Span, Status, StatusCode

from services.router.prefill_choice import PrefillChoice
from services.router.prefill_ledger import LocalPrefillLedger
from services.router.redis_prefill_ledger import RedisPrefillLedger
from services.router.request_log import Outcome, RequestLog
from services.router.request_prep import PreparedRequest
from services.router.route_plan import RoutePlan


def request_attributes(prepared: PreparedRequest, model: str) -> dict[str, Any]:
    """What the request asks for (set once it is validated)."""
    params = prepared.params
    return {
        "splitserve.req_id": prepared.req_id,
        "gen_ai.request.id": prepared.client_request_id,
        "gen_ai.response.model": model,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.usage.prompt_tokens": len(prepared.prompt_token_ids),
    }


def end_request_span(span: Span, log: RequestLog | None, outcome: Outcome) -> None:
    """Record how the request went (``log`` is None when it was refused before it was
    prepared) and end ``span``."""
    if span.is_recording():
        span.set_attribute("splitserve.outcome", outcome.value)
        if log is not None:
            attributes: dict[str, Any] = {
                "gen_ai.usage.completion_tokens": log.output_tokens,
                "splitserve.cached_tokens": log.cached_tokens,
                "splitserve.prefill_worker": log.prefill_worker,
                "splitserve.decode_workers": log.decode_workers,
            }
            if log.ttft_ms is not None:
                attributes["gen_ai.latency.time_to_first_token"] = log.ttft_ms / 1000
            if log.e2e_ms is not None:
                attributes["gen_ai.latency.e2e"] = log.e2e_ms / 1000
            span.set_attributes(attributes)
        if outcome is Outcome.ERROR:  # the server's failure, not the client's choice or mistake
            span.set_status(Status(StatusCode.ERROR, outcome.value))
    span.end()


def route_attributes(plan: RoutePlan) -> dict[str, Any]:
    """The routing decision: where the prompt is prefilled and why, both pools' candidates
    with their scores, the choices, and the ledger's kind and time."""
    choice = plan.prefill
    return {
        "splitserve.route.prefill_place": plan.place.value,
        "splitserve.route.prompt_blocks": len(choice.block_hashes),
        "splitserve.route.prefill_worker": plan.prefill_worker.address
        if plan.prefill_worker is not None
        else "",
        "splitserve.route.predicted_hit_blocks": choice.matched_blocks,
        "splitserve.route.decode_worker": plan.decode.worker.address
        if plan.decode is not None
        else "",
        "splitserve.route.prefill_candidates": [
            f"{c.worker.address} matched={c.score.matched_blocks} "
            f"queued={c.score.queued_blocks:.1f} cost={c.score.cost:.2f} "
            f"eligible={c.score.eligible}"
            for c in sorted(choice.candidates, key=lambda c: c.score.cost)
        ],
        "splitserve.route.decode_candidates": [
            f"{c.worker.address} matched={c.matched_blocks} active={c.active_requests} "
            f"cost={c.cost:.2f}"
            for c in plan.decode_candidates
        ],
        "splitserve.route.ledger": _ledger_kind(choice),
        "splitserve.route.ledger_ms": choice.ledger_s * 1000,
    }


def _ledger_kind(choice: PrefillChoice) -> str:
    """``redis``, ``in_process``, or ``load_only`` (Redis unreachable: no prefix term)."""
    if isinstance(choice.ledger, RedisPrefillLedger):
        return "redis"
    if isinstance(choice.ledger, LocalPrefillLedger) and choice.ledger.has_index:
        return "in_process"
    return "load_only"


def end_call_span(span: Span, error: str) -> None:
    """End a worker call's span, failed with ``error`` when there was one."""
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()
