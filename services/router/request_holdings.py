"""``Holdings``: what one request holds on workers while the router runs it.

A request holds up to three things on workers, each released exactly once:

- its **in-flight slot**: the decode worker that counts it (so that a burst spreads), moved
  along on a failover;
- its **prefill reservation** (``PrefillChoice.reservation``): the prompt tokens it adds to a
  prefill worker's queue (or, colocated, to the decode replica's) until the prefill is done
  (or, colocated, until the first token);
- its **KV lease**: the prefill worker keeps the prompt's KV blocks for the decode worker to
  pull; the router releases them if no decode worker takes the pull over (a failure before the
  first decoded token, a failover that recomputes the prompt, a cancelled call).

``close`` releases whatever is still held; ``RoutedRequest.run`` calls it in a ``finally``.
"""

from __future__ import annotations

import logging

import grpc

from services.common.background import BackgroundTasks
from services.router.prefill_choice import PrefillChoice, PrefillChooser
from services.router.route_plan import PrefillPlace, RoutePlan
from services.router.worker_pool import InflightSlot, WorkerHandle
from splitserve.v1 import worker_pb2

logger = logging.getLogger(__name__)

_RELEASE_TIMEOUT_S = 5.0
# The places whose plan holds a reservation (see ``RoutePlan``).
_RESERVING_PLACES = (PrefillPlace.PREFILL_WORKER, PrefillPlace.COLOCATED)


class Holdings:
    """Request ``req_id``'s slot, reservation and lease; ``chooser`` is the prefill chooser
    the reservation was made with, ``background`` runs releases nobody waits for."""

    def __init__(self, req_id: str, chooser: PrefillChooser, background: BackgroundTasks) -> None:
        self.req_id = req_id
        self.slot = InflightSlot()
        self._chooser = chooser
        self._background = background
        self._lease: WorkerHandle | None = None
        self._reserved: PrefillChoice | None = None  # its reservation not yet released

    def planned(self, plan: RoutePlan) -> None:
        """Take ``plan``'s reservation (if any) and count the request on its decode worker."""
        if plan.place in _RESERVING_PLACES and plan.prefill.reservation is not None:
            self._reserved = plan.prefill
        self.slot.move_to(plan.decode.worker if plan.decode is not None else None)

    async def prefill_done(
        self, plan: RoutePlan, worker: WorkerHandle, response: worker_pb2.PrefillResponse | None
    ) -> None:
        """The prefill on ``worker`` ended, with its ``response`` or without one (it failed:
        the prefix index forgets what it assumed the worker caches). Releases the reservation;
        a response with KV makes its blocks our lease."""
        self._reserved = None
        self._chooser.done(plan.prefill, response)
        if response is None:
            await self._chooser.forget(worker)
        elif response.HasField("kv_ref"):
            self._lease = worker

    def decode_started(self) -> None:
        """A decode worker streams tokens: it owns the KV pull (and its release) now, and a
        colocated replica has prefilled (its reservation is released)."""
        self._lease = None
        self._release_reservation()

    def drop_lease(self) -> None:
        """No decode worker will pull the leased blocks (the prompt is recomputed): release
        them in the background."""
        if self._lease is not None:
            self._background.spawn(release_lease(self._lease, self.req_id))
            self._lease = None

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
    """Tell ``worker`` (either role) to free the KV blocks leased under ``req_id``. Best
    effort: a failure is logged (the worker's lease expires on its own)."""
    try:
        await worker.stub.Release(
            worker_pb2.ReleaseRequest(request_id=req_id), timeout=_RELEASE_TIMEOUT_S
        )
    except grpc.aio.AioRpcError as exc:
        logger.warning(
            "req_id=%s release on %s failed: %s", req_id, worker.address, exc.code().name
        )
