"""Ref-counted pool of KV blocks with prefix caching and cache events.

Every block is in exactly one of three sets::

    in use     ref_cnt > 0                      (may be hashed: shared prefix blocks)
    cached     ref_cnt == 0, hashed             (reusable by a prefix hit until evicted, LRU)
    free       ref_cnt == 0, not hashed         (handed out first)

``num_free + num_cached + num_in_use == num_blocks`` always holds (see ``check_integrity``).
Every change to the set of hashed blocks is recorded as an event for the router's prefix index.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of the paged KV cache: ``block_size`` token slots in every layer."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class KVMedium(enum.Enum):
    """Where an engine holds a block a prefix hit can use (vLLM's KV events name it too): its
    paged cache, or only its second tier (``engine.kv_offload``), loaded back on a hit."""

    CACHE = "cache"
    TIER = "tier"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks became reusable by prefix hits; ``block_hashes`` form a chain after ``parent``.
    ``medium`` says where the engine holds them now: a block stored again in another medium
    moved there (from the cache into the tier when evicted, back when loaded)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    block_size: int
    medium: KVMedium = KVMedium.CACHE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted: their hashes no longer hit."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block was dropped (prefix cache reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are requested than are free or evictable."""


class DoubleFreeError(RuntimeError):
    """A block was freed more often than it was referenced (a bookkeeping bug upstream)."""


class BlockPool:
    """Owns every ``KVCacheBlock`` of one engine.

    Not thread-safe: the scheduler thread is the only caller.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self._free: deque[KVCacheBlock] = deque(self.blocks)
        # Insertion order is recency of release: the first entry is evicted first.
        self._cached: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self._hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self._events: list[KVCacheEvent] = []
        # Called with (block_id, block_hash) for each cached block evicted to be reused,
        # before anything can write into it (the engine's second tier copies it).
        self.on_evict: Callable[[int, BlockHash], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take right now (free plus evictable cached)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold reusable prefix KV (evicted last-released-last)."""
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding ``block_hash``'s KV, in use or cached, if any. No side effects."""
        return self._hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling cached ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._cached[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out ``num_blocks`` blocks with ref_cnt 1: unhashed first, then evict LRU cached."""
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {num_blocks} blocks, {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        evicted: list[BlockHash] = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.popleft()
            else:
                _, block = self._cached.popitem(last=False)
                assert block.block_hash is not None
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
                evicted.append(block.block_hash)
                del self._hash_to_block[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        return out

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order.

        Callers pass a request's blocks tail first so that, among blocks released together, the
        end of a sequence is evicted before its (more widely shared) beginning. Raises
        ``DoubleFreeError`` before changing anything if a block has no reference to drop.
        """
        unreferenced = [b.block_id for b in blocks if b.ref_cnt <= 0]
        if unreferenced or len({b.block_id for b in blocks}) != len(blocks):
            raise DoubleFreeError(f"freeing blocks without a reference: {unreferenced or blocks}")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free.append(block)
                else:
                    self._cached[block.block_id] = block

    def cache_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
    ) -> None:
        """Publish full, computed blocks for prefix hits. Blocks must be in use.

        A block whose hash is already held by another block (the same prefix computed twice
        concurrently) stays unhashed: the first copy remains the cached one.
        """
        if not self.enable_caching:
            return
        stored: list[BlockHash] = []
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None or block_hash in self._hash_to_block:
                continue
            block.block_hash = block_hash
            self._hash_to_block[block_hash] = block
            stored.append(block_hash)
        if stored:
            self._events.append(BlockStored(tuple(stored), parent_block_hash, self.block_size))

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Withdraw ``blocks`` from prefix hits (their content is not to be trusted). Cached
        ones become plain free blocks; in-use ones stay in use, unhashed."""
        removed: list[BlockHash] = []
        for block in blocks:
            if block.block_hash is None:
                continue
            removed.append(block.block_hash)
            del self._hash_to_block[block.block_hash]
            block.block_hash = None
            if self._cached.pop(block.block_id, None) is not None:
                self._free.append(block)
        if removed:
            self._events.append(BlockRemoved(tuple(removed)))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash. Only possible when no block is in use; returns success."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
            self._free.append(block)
        self._cached.clear()
        self._hash_to_block.clear()
        self._events.append(AllBlocksCleared())
        return True

    @property
    def hash_map(self) -> dict[BlockHash, KVCacheBlock]:
        """The live map from hash to the block holding it (read only)."""
        return self._hash_to_block

    def block_hashes(self) -> list[BlockHash]:
        """Hashes of every block that can give a prefix hit now (in use or cached)."""
        return list(self._hash_to_block)

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the events recorded since the last call."""
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the pool's bookkeeping is inconsistent."""
        free_ids = {b.block_id for b in self._free}
        cached_ids = set(self._cached)
        in_use_ids = {b.block_id for b in self.blocks if b.ref_cnt > 0}
        assert len(free_ids) == len(self._free), "a block is twice in the free queue"
        assert not (free_ids & cached_ids), "a block is both free and cached"
        assert not (in_use_ids & (free_ids | cached_ids)), "an in-use block is in a free set"
        assert len(free_ids) + len(cached_ids) + len(in_use_ids) == self.num_blocks, (
            f"free {len(free_ids)} + cached {len(cached_ids)} + in use {len(in_use_ids)} "
            f"!= {self.num_blocks}"
        )
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert all(b.block_hash is None for b in self._free), "a free block is hashed"
        assert all(b.block_hash is not None for b in self._cached.values())
        for block_hash, block in self._hash_to_block.items():
            assert block.block_hash == block_hash, "hash map out of sync with block"
        hashed = sum(b.block_hash is not None for b in self.blocks)
        assert hashed == len(self._hash_to_block), "a hashed block is missing from the map"
