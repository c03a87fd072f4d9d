"""Pinning a prompt's prefix on the peer that caches it, for the prefill worker to pull.

When the plan says "pull the first N blocks from W" (``route_plan.PeerPull``), the router asks
W to lease the longest run of those blocks its cache still holds (``PinPrefix``) and hands the
reference to the prefill worker with its ``Prefill``; the prefill worker pulls them and
computes only the rest. Every failure degrades to computing the prefix: W no longer caches it
(evicted since the index said so), W is down or slow, or the pull itself fails on the prefill
worker. None fails the request; each is counted (``splitserve_router_peer_pulls_total``).
"""

from __future__ import annotations

import enum
import logging

import grpc

from services.router import metrics
from services.router.request_prep import PreparedRequest
from services.router.route_plan import PeerPull
from splitserve.v1 import worker_pb2

logger = logging.getLogger(__name__)

# A pin is an engine-thread lookup on the peer: a slow answer costs more than recomputing.
PIN_TIMEOUT_S = 0.5


class PeerPullOutcome(enum.Enum):
    """How a planned peer pull ended (the ``outcome`` label)."""

    PULLED = "pulled"
    NOT_CACHED = "not_cached"  # the peer held none of the prefix any more
    PIN_FAILED = "pin_failed"  # the peer did not answer the pin (down, slow, refused)
    PULL_FAILED = "pull_failed"  # the prefill worker could not pull: it computed the prefix


def pin_id(req_id: str) -> str:
    """The id a request's pinned prefix is leased under on its peer (never a request's id)."""
    return f"{req_id}#peer-prefix"


async def pin_peer_prefix(
    pull: PeerPull, prepared: PreparedRequest, ttl_s: float
) -> worker_pb2.PinPrefixResponse | None:
    """Ask ``pull.source`` to lease the prompt's cached prefix (at most ``pull.num_blocks``)
    for up to ``ttl_s`` (the prefill call's deadline: the request may queue on its prefill
    worker before it reads; the caller releases the pin when the call ends without the read);
    the response when it holds some of it, None (counted) otherwise. Never raises a worker's
    error: the prefill worker then computes the prefix."""
    request = worker_pb2.PinPrefixRequest(
        pin_id=pin_id(prepared.req_id),
        prompt_token_ids=prepared.prompt_token_ids,
        max_blocks=pull.num_blocks,
        cache_salt=prepared.cache_salt,
        lora_name=prepared.lora_name,
        ttl_s=ttl_s,
    )
    try:
        response: worker_pb2.PinPrefixResponse = await pull.source.stub.PinPrefix(
            request, timeout=PIN_TIMEOUT_S
        )
    except grpc.aio.AioRpcError as exc:
        logger.info(
            "req_id=%s pin on %s failed (%s): the prefill worker computes the prefix",
            prepared.req_id,
            pull.source.address,
            exc.code().name,
        )
        count(PeerPullOutcome.PIN_FAILED)
        return None
    if not response.HasField("kv_ref"):
        count(PeerPullOutcome.NOT_CACHED)
        return None
    return response


def count(outcome: PeerPullOutcome, num_blocks: int = 0) -> None:
    """Count a planned peer pull's end, and the blocks it pulled."""
    metrics.PEER_PULLS.labels(outcome.value).inc()
    if num_blocks:
        metrics.PEER_PULLED_BLOCKS.inc(num_blocks)
