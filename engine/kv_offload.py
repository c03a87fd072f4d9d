"""Moves KV blocks between the engine's paged cache and its second tier (``engine.kv_tier``).

The block pool hands each block it evicts to ``save`` before the block is reused (the block's
bytes are copied at once; the tier writes them later), and the scheduler asks ``num_hits`` and
``load`` when it admits a request whose prefix continues in the tier past the cache. A block's
hash names its adapter by the adapter's weights (``LoraAdapter.block_key``), so an adapter's
blocks are kept too.
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Container, Iterable, Sequence
from pathlib import Path

import torch

from engine.block_hash import BlockHash
from engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVMedium
from engine.kv_cache_spec import KVCacheSpec
from engine.kv_tier import DiskKVTier, HostKVTier, KVTier, TierIdentity, model_fingerprint
from engine.moving_average import MovingAverage

logger = logging.getLogger(__name__)


class KVOffload:
    """The engine's door to its tier. Called on the scheduler thread only.

    ``kv_cache`` is the engine's block-major cache ``[num_blocks, *block_shape]``: block ``i``
    is the contiguous region ``kv_cache[i]``, moved as raw bytes.
    """

    def __init__(self, tier: KVTier, kv_cache: torch.Tensor, block_size: int) -> None:
        self.tier = tier
        self.block_size = block_size
        # Seconds to load one block back into the cache (read, check, copy), as measured.
        self.load_s_per_block = MovingAverage()
        self._blocks = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)

    @property
    def num_cache_blocks(self) -> int:
        return int(self._blocks.shape[0])

    @property
    def block_bytes(self) -> int:
        return int(self._blocks.shape[1])

    def save(self, block_id: int, block_hash: BlockHash) -> None:
        """Copy an evicted block into the tier (no-op if it holds that hash already)."""
        if block_hash in self.tier:
            return
        self.tier.put(block_hash, self._blocks[block_id].cpu().numpy().tobytes())

    def held_events(
        self, events: Sequence[KVCacheEvent], cached: Container[BlockHash]
    ) -> list[KVCacheEvent]:
        """The cache's ``events`` restated for the blocks held in the cache *or* the tier, each
        with where it is (what the router's index must know: a hit in either saves the compute,
        a hit in the tier costs its load). ``cached`` is the cache's live hash map: a block the
        cache evicted into the tier is stored again as the tier's, a removal is kept only for
        blocks in neither, the tier's own drops are added, and after a reset of the cache the
        tier's blocks are stored again as the tier's."""
        out: list[KVCacheEvent] = []
        cleared = False
        for event in events:
            if isinstance(event, BlockRemoved):
                out += self._removed(event.block_hashes, cached)
            else:
                cleared |= isinstance(event, AllBlocksCleared)
                out.append(event)
        out += self._removed(self.tier.take_removed(), cached)
        if cleared and (held := self.tier.hashes()):
            out.append(BlockStored(tuple(held), None, self.block_size, KVMedium.TIER))
        return out

    def _removed(
        self, block_hashes: Iterable[BlockHash], cached: Container[BlockHash]
    ) -> list[KVCacheEvent]:
        """The events for ``block_hashes`` having left the cache or the tier: those still in the
        cache change nothing, those in the tier alone moved there, the others are gone."""
        moved: list[BlockHash] = []
        gone: list[BlockHash] = []
        for block_hash in block_hashes:
            if block_hash not in cached:
                (moved if block_hash in self.tier else gone).append(block_hash)
        out: list[KVCacheEvent] = []
        if moved:
            out.append(BlockStored(tuple(moved), None, self.block_size, KVMedium.TIER))
        if gone:
            out.append(BlockRemoved(tuple(gone)))
        return out

    def num_hits(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, the tier holds. No side effects."""
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self.tier:
                break
            n += 1
        return n

    def load(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        """Fill ``block_ids`` with the tier's copies of ``block_hashes``, in order; stop at the
        first one the tier no longer has or refuses. Returns how many were loaded; measures
        ``load_s_per_block``."""
        start_s = time.perf_counter()
        num_loaded = 0
        for block_hash, block_id in zip(block_hashes, block_ids, strict=True):
            payload = self.tier.get(block_hash)
            if payload is None:
                break
            self._blocks[block_id].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            num_loaded += 1
        if num_loaded:
            self.load_s_per_block.add((time.perf_counter() - start_s) / num_loaded)
        return num_loaded

    def close(self) -> None:
        self.tier.close()


def build_offload(
    kv_cache: torch.Tensor,
    spec: KVCacheSpec,
    capacity_gib: float,
    directory: str | None,
    model_path: Path,
    dtype: str,
) -> KVOffload:
    """A disk tier under ``directory``, else one in host memory, of ``capacity_gib``.
    ``ValueError`` naming the flag for a directory that cannot be used."""
    capacity_bytes = int(capacity_gib * 2**30)
    tier: KVTier
    if directory:
        identity = TierIdentity(model_fingerprint(model_path), dtype, spec.compat_hash())
        try:
            tier = DiskKVTier(Path(directory), capacity_bytes, spec.block_bytes, identity)
        except OSError as exc:
            raise ValueError(f"--kv-offload-dir {directory}: {exc.strerror or exc}") from None
        # A clean exit writes the blocks still queued; after a crash they are recomputed.
        atexit.register(tier.close)
        logger.info("KV tier: %.2f GiB on disk at %s", capacity_gib, tier.directory)
    else:
        tier = HostKVTier(capacity_bytes, spec.block_bytes)
        logger.info("KV tier: %.2f GiB of host memory", capacity_gib)
    return KVOffload(tier, kv_cache, spec.block_size)
