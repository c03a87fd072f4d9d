"""Leases: the blocks of finished prefills, and prefixes pinned for a peer, kept until pulled.

A finished prefill's blocks, and a cached prefix pinned for a peer (``pin``), are published to
the KV transfer backend under the request (or pin) id and stay allocated until one of: the
reader releases them through the backend after its pull, the router calls ``Release`` (the
request ended without a pull), or the lease expires (the reader never came). An abandoned
request therefore never strands KV for longer than the TTL.

A released lease is unpublished at once (no new read is served), but its blocks stay pinned while
reads of them are still sending (a slow or hung reader, up to the backend's io timeout): they are
freed by the first step after the backend reports them unpublished (``take_unpublished``). So
no reader stalls the engine thread, and a hung reader delays the freeing of its own lease's
blocks only, never another lease's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.backend import EngineBackend
from engine.outputs import RequestOutput
from kvtransfer.base import KVTransferBackend

logger = logging.getLogger(__name__)

# A pinned prefix may wait this many lease TTLs for its reader (see ``LeaseHooks.pin``).
MAX_PIN_TTL_FACTOR = 10


@dataclass(frozen=True, slots=True)
class Lease:
    """A finished prefill's published blocks; ``grant`` is what the backend's ``publish``
    returned, which the decode side must present (in ``KVRef.grant``) to pull or release them."""

    block_ids: tuple[int, ...]
    grant: bytes = field(repr=False)
    expires_at_s: float
    ttl_s: float


class LeaseHooks:
    """``EngineHooks`` of a prefill worker. All methods run on the engine thread except
    ``get``, a lock-free read used by gRPC handlers after the request's final output."""

    def __init__(self, backend: KVTransferBackend, ttl_s: float) -> None:
        self.backend = backend
        self.ttl_s = ttl_s
        self._leases: dict[str, Lease] = {}
        self.num_leases_expired = 0
        # Released leases whose blocks readers may still be sending; freed once reported.
        self._unpublishing: set[str] = set()
        # The TTL of the lease a request in flight takes when it finishes (``wait_for_reader``).
        self._reader_ttl_s: dict[str, float] = {}

    def get(self, req_id: str) -> Lease | None:
        return self._leases.get(req_id)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def busy(self) -> bool:
        return bool(self._leases or self._unpublishing)

    def after_step(self, engine: EngineBackend, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if not output.finished:
                continue
            ttl_s = self._reader_ttl_s.pop(output.req_id, None)
            block_ids = engine.held_kv_block_ids(output.req_id)
            if block_ids:
                self._lease(output.req_id, block_ids, ttl_s)

    def wait_for_reader(self, req_id: str, ttl_s: float) -> None:
        """The lease that ``req_id``'s prefill takes when it finishes waits ``ttl_s`` for its
        reader (0: the TTL of every lease), at most ``MAX_PIN_TTL_FACTOR`` times that TTL: a
        decode worker may queue the request before it pulls, and a lease that expires first
        costs the whole prompt's recompute there. Call before adding the request."""
        if ttl_s > 0:
            self._reader_ttl_s[req_id] = min(ttl_s, MAX_PIN_TTL_FACTOR * self.ttl_s)

    def pin(
        self,
        engine: EngineBackend,
        pin_id: str,
        prompt_token_ids: Sequence[int],
        max_blocks: int,
        *,
        cache_salt: str,
        lora_name: str,
        ttl_s: float = 0.0,
    ) -> Lease | None:
        """Lease the longest cached run (at most ``max_blocks``) of the prompt's blocks under
        ``pin_id`` for a peer to pull (``EngineBackend.pin_prefix``); None when none is cached.
        It ends as a prefill's lease does: released by the reader, by ``release``, or expired.
        ``ttl_s`` (0: the TTL of every lease) is how long the reader may take to come: the
        request it is for may queue on its prefill worker first; at most ``MAX_PIN_TTL_FACTOR``
        times the TTL, so that a router that died never strands blocks for long.
        ``DuplicateRequestError`` if ``pin_id`` is in use here."""
        block_ids = engine.pin_prefix(
            pin_id, prompt_token_ids, max_blocks, cache_salt=cache_salt, lora_name=lora_name
        )
        if not block_ids:
            return None
        ttl_s = min(ttl_s or self.ttl_s, MAX_PIN_TTL_FACTOR * self.ttl_s)
        return self._lease(pin_id, block_ids, ttl_s)

    def _lease(self, req_id: str, block_ids: list[int], ttl_s: float | None = None) -> Lease:
        ttl_s = self.ttl_s if ttl_s is None else ttl_s
        grant = self.backend.publish(req_id, block_ids)
        lease = Lease(tuple(block_ids), grant, time.monotonic() + ttl_s, ttl_s)
        self._leases[req_id] = lease
        return lease

    def before_step(self, engine: EngineBackend) -> None:
        for req_id in self.backend.take_released():
            self.release(engine, req_id)
        if self._leases:
            now_s = time.monotonic()
            expired = [item for item in self._leases.items() if item[1].expires_at_s <= now_s]
            for req_id, lease in expired:
                logger.warning("req_id=%s KV lease expired after %.1f s", req_id, lease.ttl_s)
                self.num_leases_expired += 1
                self.release(engine, req_id)
        if self._unpublishing:
            for req_id in self.backend.take_unpublished():
                self._unpublishing.discard(req_id)
                engine.release_held_kv(req_id)

    def abort(self, engine: EngineBackend, req_id: str) -> list[RequestOutput]:
        self._reader_ttl_s.pop(req_id, None)
        outputs = engine.abort_requests([req_id])
        self.release(engine, req_id)
        return outputs

    def release(self, engine: EngineBackend, req_id: str) -> bool:
        """Unpublish a finished prefill's blocks now, and free them once no read of them is
        sending any more (a later ``before_step``). Never blocks. False if it holds none."""
        self._leases.pop(req_id, None)
        held = engine.holds_kv(req_id)
        if held and req_id not in self._unpublishing:
            self._unpublishing.add(req_id)
            self.backend.unpublish(req_id)
        return held
