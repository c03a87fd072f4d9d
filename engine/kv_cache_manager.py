"""Per-request view of the block pool: prefix hits, slot allocation, caching, freeing.

A request's blocks cover its token positions in order::

    | block 0 | block 1 | ... | block k |      block i holds tokens [i*B, (i+1)*B)
    |<- num_cached_blocks ->|               full, hashed, shareable
    |<----- num_computed_tokens ----->|      KV written
    |<------ computed + new tokens --------->| slots allocated this step
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.block_hash import BlockHash
from engine.block_pool import BlockPool, KVCacheBlock, KVCacheEvent, KVMedium
from engine.request import Request

if TYPE_CHECKING:
    from engine.kv_offload import KVOffload


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates and frees the blocks of each request; the scheduler's only door to the pool.

    Blocks are keyed by request id, and an id's blocks belong to the ``Request`` that got them
    until ``free``: no other request with that id (a reused id) may extend or cache them, and
    neither may their owner once finished (a lease holds them for a KV pull).

    With an ``offload`` (a second tier), evicted blocks go to the tier, and a
    request's prefix that continues in the tier past the cache is loaded back from it
    (``num_offloaded_hits``, ``load_offloaded``) instead of being recomputed.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        offload: KVOffload | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.offload = offload if enable_prefix_caching else None
        if self.offload is not None:
            self.block_pool.on_evict = self.offload.save
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The ids of ``req_to_blocks``' blocks, kept alongside (read every step).
        self._block_ids: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._owners: dict[str, Request] = {}

    def get_block_ids(self, req_id: str) -> list[int]:
        """A copy of the request's block ids, in token order ([] if none)."""
        return list(self._block_ids.get(req_id, ()))

    def block_ids_view(self, req_id: str) -> list[int]:
        """The request's block ids, in token order: the live list, which the next allocation
        extends and ``free`` drops (the scheduler's per-step read; do not modify it)."""
        return self._block_ids.get(req_id, [])

    def has_blocks(self, req_id: str) -> bool:
        """Whether ``req_id`` holds blocks now; a waiting request may (one back from a KV load).
        No side effects."""
        return req_id in self.req_to_blocks

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Longest run of the request's full blocks already cached here. No side effects.

        At least one token is always left to compute, because its logits give the next token.
        None for a request that asks for prompt logprobs: every prompt token's logits are needed.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[: self._max_hit_blocks(request)]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_offloaded_hits(self, request: Request, num_cached_blocks: int) -> int:
        """How many full blocks after the request's first ``num_cached_blocks`` (its hits in
        the cache) the second tier holds, within the blocks a hit may cover. No side effects."""
        if self.offload is None or request.sampling_params.prompt_logprobs is not None:
            return 0
        hashes = request.block_hashes[num_cached_blocks : self._max_hit_blocks(request)]
        return self.offload.num_hits(hashes)

    def load_offloaded(self, request: Request, first_block: int, num_blocks: int) -> int:
        """Fill the request's blocks ``[first_block, first_block + num_blocks)`` (allocated,
        not computed, not published) from the second tier, in order; returns how many it
        filled (it stops at the first block the tier no longer has or refuses)."""
        assert self.offload is not None
        end = first_block + num_blocks
        return self.offload.load(
            request.block_hashes[first_block:end], self._block_ids[request.req_id][first_block:end]
        )

    def _max_hit_blocks(self, request: Request) -> int:
        # At least one token is left to compute: its logits give the next token.
        return (request.num_tokens - 1) // self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        cache: bool = True,
    ) -> bool:
        """Make room for ``num_new_tokens`` after the computed ones; False if out of blocks.

        ``new_computed_blocks`` are prefix hits from ``get_computed_blocks`` (first allocation
        only); they are referenced and their tokens count as computed. With ``cache`` the blocks
        that are full once this step's tokens are written are published for prefix hits; pass
        False when their content arrives later (remote KV) and call ``cache_blocks`` then.
        On False nothing changed. ``RuntimeError`` if the id's blocks are not the request's to
        extend (see the class).
        """
        self._check_owner(request)
        if not new_computed_blocks:
            blocks = self.req_to_blocks.get(request.req_id)
            num_tokens = request.num_computed_tokens + num_new_tokens
            if blocks is not None and cdiv(num_tokens, self.block_size) <= len(blocks):
                # The common decode step: its slots are in blocks the request holds.
                if cache:
                    self.cache_blocks(request, num_tokens)
                return True
        hits = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.req_id, [])
        num_computed_tokens = request.num_computed_tokens + len(hits) * self.block_size
        num_required_blocks = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = max(num_required_blocks - len(blocks) - len(hits), 0)
        # Hits that sit in the cached (evictable) set stop being allocatable once touched.
        num_evictable_hits = sum(b.ref_cnt == 0 for b in hits)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_to_blocks[request.req_id]
            return False
        self._owners[request.req_id] = request
        self.block_pool.touch(hits)
        new_blocks = hits + self.block_pool.allocate(num_new_blocks) if num_new_blocks else hits
        blocks.extend(new_blocks)
        self._block_ids.setdefault(request.req_id, []).extend(b.block_id for b in new_blocks)
        if hits:
            self._num_cached_blocks[request.req_id] = len(hits)
        if cache:
            self.cache_blocks(request, num_computed_tokens + num_new_tokens)
        return True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's blocks that are full within its first ``num_tokens`` tokens."""
        if not self.enable_prefix_caching:
            return
        self._check_owner(request)
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_cached = self._num_cached_blocks.get(request.req_id, 0)
        if num_full <= num_cached:
            return
        blocks = self.req_to_blocks[request.req_id]
        hashes = request.block_hashes
        parent = hashes[num_cached - 1] if num_cached else None
        self.block_pool.cache_blocks(
            blocks[num_cached:num_full],
            hashes[num_cached:num_full],
            parent,
        )
        self._num_cached_blocks[request.req_id] = num_full

    def free(self, request: Request, *, uncache: bool = False) -> None:
        """Release every block of the request (tail first); cached ones stay hittable unless
        ``uncache``: then the blocks it computed itself (not its prefix hits) are withdrawn from
        the prefix cache, because their content may be garbage (a failed computation)."""
        self._check_owner(request, extending=False)
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self._owners.pop(request.req_id, None)
        self._block_ids.pop(request.req_id, None)
        self._num_cached_blocks.pop(request.req_id, None)
        self.block_pool.free(blocks[::-1])
        if uncache:
            num_hit_blocks = max(request.num_cached_tokens, 0) // self.block_size
            self.block_pool.uncache(blocks[num_hit_blocks:])

    def _check_owner(self, request: Request, *, extending: bool = True) -> None:
        """``RuntimeError`` unless ``request`` owns the blocks of its id (or none has them)
        and, when ``extending`` them, is not finished."""
        owner = self._owners.get(request.req_id, request)
        if owner is not request:
            raise RuntimeError(
                f"req_id {request.req_id!r} is reused: its blocks belong to another request "
                f"({owner.status.name})"
            )
        if extending and request.status.is_finished:
            raise RuntimeError(
                f"req_id {request.req_id!r} finished ({request.status.name}): its blocks take "
                "no new tokens"
            )

    def take_events(self) -> list[KVCacheEvent]:
        """Changes to the blocks a prefix hit can use (the cache's, and the tier's when there
        is one) since the last call."""
        events = self.block_pool.take_events()
        if self.offload is None:
            return events
        return self.offload.held_events(events, self.block_pool.hash_map)

    def held_blocks(self) -> dict[BlockHash, KVMedium]:
        """Every block a prefix hit can use now, and where it is (the cache, when in both):
        the state ``take_events`` reports."""
        held = dict.fromkeys(self.block_pool.block_hashes(), KVMedium.CACHE)
        if self.offload is not None:
            for block_hash in self.offload.tier.hashes():
                held.setdefault(block_hash, KVMedium.TIER)
        return held

    def check_integrity(self) -> None:
        """Pool invariants plus: every block a request holds has a positive ref count."""
        self.block_pool.check_integrity()
        for req_id, blocks in self.req_to_blocks.items():
            assert all(b.ref_cnt > 0 for b in blocks), f"{req_id} holds a released block"
            assert self._block_ids.get(req_id, []) == [b.block_id for b in blocks], req_id
        assert set(self._block_ids) <= set(self.req_to_blocks)
        assert set(self._owners) == set(self.req_to_blocks)
