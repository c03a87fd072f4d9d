"""vLLM's prefix-cache events as splitserve's, so the router's prefix index covers vLLM pools.

vLLM names a block by its own hash; splitserve's router hashes prompts with ``engine.block_hash``
(``cache_salt`` and the LoRA adapter's block key in every block). vLLM's ``BlockStored`` carries
each block's token ids, its adapter's name (``VLLMAdapterLoader`` names adapters to vLLM by their
block keys) and, on a chain's first block, its ``cache_salt``, so the splitserve hash of every
stored block can be computed here, chained through the parent's. The translator keeps the mapping
of live blocks, which is also the state ``prefix_cache_blocks`` reports.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from engine.block_hash import ROOT_PARENT_HASH, BlockHash, block_extra_key, hash_block
from engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

logger = logging.getLogger(__name__)


class EventCollector:
    """Stands in for vLLM's KV event publisher inside this process: the scheduler hands it
    each step's events and ``take`` returns them (vLLM's ``EventPublisher`` interface:
    ``publish``, ``shutdown``, ``get_publisher_config``)."""

    def __init__(self) -> None:
        self._events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self._events.extend(batch.events)

    def shutdown(self) -> None:
        self._events.clear()

    def get_publisher_config(self) -> None:
        return None

    def take(self) -> list[Any]:
        events, self._events = self._events, []
        return events


class EventTranslator:
    """Turns vLLM KV events into splitserve ``KVCacheEvent``s for one ``block_size``."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # vLLM's hash of a live block -> (splitserve's hash, the chain's block_extra_key)
        self._live: dict[Any, tuple[BlockHash, str]] = {}

    def translate(self, events: Iterable[Any]) -> list[KVCacheEvent]:
        """splitserve's events for vLLM's ``events``, in order. Blocks of another KV cache
        group (hybrid models' sliding-window layers) and blocks whose parent is unknown (its
        store was never seen) are skipped: the router then misses a hit, never invents one."""
        from vllm.distributed.kv_events import AllBlocksCleared as VllmCleared
        from vllm.distributed.kv_events import BlockRemoved as VllmRemoved
        from vllm.distributed.kv_events import BlockStored as VllmStored

        out: list[KVCacheEvent] = []
        for event in events:
            if getattr(event, "group_idx", None) not in (None, 0):
                continue
            if isinstance(event, VllmStored):
                stored = self._stored(event)
                if stored is not None:
                    out.append(stored)
            elif isinstance(event, VllmRemoved):
                gone = [self._live.pop(h)[0] for h in event.block_hashes if h in self._live]
                if gone:
                    out.append(BlockRemoved(tuple(gone)))
            elif isinstance(event, VllmCleared):
                self._live.clear()
                out.append(AllBlocksCleared())
        return out

    def _stored(self, event: Any) -> BlockStored | None:
        if event.block_size != self.block_size:
            return None
        if event.parent_block_hash is None:
            lora_key = event.lora_name or ""
            salt = _cache_salt(event.extra_keys, lora_key)
            parent, extra_key = ROOT_PARENT_HASH, block_extra_key(salt, lora_key)
        elif event.parent_block_hash in self._live:
            parent, extra_key = self._live[event.parent_block_hash]
        else:
            logger.debug("KV event for a block whose parent was never stored; skipped")
            return None
        first_parent = None if parent == ROOT_PARENT_HASH else parent
        hashes: list[BlockHash] = []
        for i, vllm_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * self.block_size : (i + 1) * self.block_size]
            parent = hash_block(parent, tokens, extra_key)
            self._live[vllm_hash] = (parent, extra_key)
            hashes.append(parent)
        if not hashes:
            return None
        return BlockStored(tuple(hashes), first_parent, self.block_size)

    @property
    def num_live_blocks(self) -> int:
        """How many blocks vLLM can hit now (``stats`` reads it every loop turn: no copy)."""
        return len(self._live)

    def live_block_hashes(self) -> list[BlockHash]:
        """splitserve's hashes of every block vLLM can hit now."""
        return [splitserve_hash for splitserve_hash, _ in self._live.values()]


def _cache_salt(extra_keys: list[tuple[Any, ...] | None] | None, lora_name: str) -> str:
    """The ``cache_salt`` in a chain's first block's extra keys ("" when unsalted). They hold,
    in order, the adapter's name (when ``lora_name``), multimodal keys (never sent by the
    workers) and the salt: the salt is the plain string after the adapter's name."""
    if not extra_keys or not extra_keys[0]:
        return ""
    strings = [key for key in extra_keys[0] if isinstance(key, str)]
    if lora_name and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[-1] if strings else ""
