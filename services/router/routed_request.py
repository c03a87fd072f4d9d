"""``RoutedRequest``: one ``Generate`` call's state in the router, and what it holds on workers.

A request holds up to three things on workers, each released exactly once:

- its **in-flight slot**: the decode worker that counts it (so that a burst spreads), moved
  along on a failover;
- its **prefill reservation** (``PrefillChoice.reservation``): the prompt tokens it adds to a
  prefill worker's queue (or, colocated, to the decode replica's) until the prefill is done
  (or, colocated, until the first token);
- its **KV lease**: the prefill worker keeps the prompt's KV blocks for the decode worker to
  pull; the router releases them if no decode worker takes the pull over (a failure before the
  first decoded token, a failover that recomputes the prompt, a cancelled call).

``close`` releases whatever is still held; the server calls it in a ``finally``.
"""

from __future__ import annotations

import logging

import grpc

from engine.tokenizer import Tokenizer
from services.common.background import BackgroundTasks
from services.common.convert import sampling_params_to_worker
from services.router.failure_policy import FailurePolicy
from services.router.prefill_choice import PrefillChoice, PrefillChooser
from services.router.request_prep import PreparedRequest
from services.router.response_stream import ResponseStream
from services.router.route_plan import PrefillPlace, RoutePlan
from services.router.worker_pool import InflightSlot, WorkerHandle
from splitserve.v1 import worker_pb2

logger = logging.getLogger(__name__)

_RELEASE_TIMEOUT_S = 5.0
# The places whose plan holds a reservation (see ``RoutePlan``).
_RESERVING_PLACES = (PrefillPlace.PREFILL_WORKER, PrefillPlace.COLOCATED)


class RoutedRequest:
    """A prepared request on its way through a prefill worker (maybe) and decode workers.

    ``stream`` turns worker tokens into client messages; ``decode_request`` is what the next
    decode worker is sent (the prompt, the tokens the client already has, the KV to pull);
    ``failures`` judges worker errors across the whole request.
    """

    def __init__(
        self,
        prepared: PreparedRequest,
        tokenizer: Tokenizer,
        chooser: PrefillChooser,
        background: BackgroundTasks,
    ) -> None:
        self.prepared = prepared
        self.req_id = prepared.req_id
        self.stream = ResponseStream(
            prepared.client_request_id, tokenizer, prepared.prompt_token_ids, prepared.params
        )
        self.worker_params = sampling_params_to_worker(prepared.params)
        self.decode_request = worker_pb2.DecodeRequest(
            request_id=self.req_id,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling=self.worker_params,
            cache_salt=prepared.cache_salt,
        )
        self.failures = FailurePolicy()
        self.slot = InflightSlot()
        self.plan: RoutePlan | None = None
        self._chooser = chooser
        self._background = background
        self._lease: WorkerHandle | None = None
        self._reserved: PrefillChoice | None = None  # its reservation not yet released

    def planned(self, plan: RoutePlan) -> None:
        """Take ``plan`` (its reservation, if any, is now ours) and count the request on its
        decode worker."""
        self.plan = plan
        if plan.place in _RESERVING_PLACES and plan.prefill.reservation is not None:
            self._reserved = plan.prefill
        self.slot.move_to(plan.decode.worker if plan.decode is not None else None)

    async def prefill_done(
        self, worker: WorkerHandle, response: worker_pb2.PrefillResponse | None
    ) -> None:
        """The prefill on ``worker`` ended, with its ``response`` or without one (it failed:
        the decode worker prefills instead, and the prefix index forgets what it assumed the
        worker caches). Releases the reservation; a response with KV makes it our lease."""
        assert self.plan is not None
        self._reserved = None
        self._chooser.done(self.plan.prefill, response)
        if response is None:
            await self._chooser.forget(worker)
            return
        if response.HasField("kv_ref"):
            self._lease = worker
            self.decode_request.kv_ref.CopyFrom(response.kv_ref)
            self.decode_request.kv_peer.CopyFrom(response.kv_peer)

    def decode_started(self) -> None:
        """A decode worker streams tokens: it owns the KV pull (and its release) now, and a
        colocated replica has prefilled (its reservation is released)."""
        self._lease = None
        self._release_reservation()

    def recompute_prompt(self) -> None:
        """The next decode worker computes the prompt instead of pulling it: no KV to pull,
        the lease released (in the background)."""
        self.decode_request.ClearField("kv_ref")
        self.decode_request.ClearField("kv_peer")
        if self._lease is not None:
            self._background.spawn(release_lease(self._lease, self.req_id))
            self._lease = None

    def finished(self) -> None:
        """The whole generation reached the client: count a colocated replica's prefix hits."""
        if self.plan is not None and self.plan.place is PrefillPlace.COLOCATED:
            self._chooser.record_hits(self.plan.prefill, self.stream.num_cached_tokens)

    async def close(self) -> None:
        """Release everything still held: the slot, the reservation (a prefill that never
        ended, a colocated replica that never answered), the lease. Idempotent."""
        self.slot.move_to(None)
        self._release_reservation()
        if self._lease is not None:
            lease, self._lease = self._lease, None
            await release_lease(lease, self.req_id)

    def _release_reservation(self) -> None:
        if self._reserved is not None:
            self._chooser.cancel(self._reserved)
            self._reserved = None


async def release_lease(worker: WorkerHandle, req_id: str) -> None:
    """Tell prefill ``worker`` to free ``req_id``'s KV blocks. Best effort: a failure is
    logged (the worker's lease expires on its own)."""
    try:
        await worker.stub.Release(
            worker_pb2.ReleaseRequest(request_id=req_id), timeout=_RELEASE_TIMEOUT_S
        )
    except grpc.aio.AioRpcError as exc:
        logger.warning(
            "req_id=%s release on %s failed: %s", req_id, worker.address, exc.code().name
        )
