"""Which worker holds which KV blocks: the router's prefix index, in process or in Redis.

Workers report their prefix-cache events (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``) and heartbeat; the router asks, for a prompt's chained block hashes, how
many leading blocks each live worker already holds. Because hashes are chained, a worker holds
a prompt's first ``n`` blocks exactly when it holds each of the hashes ``0..n-1``; a stale index
costs cache affinity, never correctness. A block is held in the worker's cache or only in its
second tier (``KVMedium``); a match counts both, and ``tier_blocks`` says how many of a match
are the tier's (loaded on a hit, not computed, yet not free).

Two implementations share ``PrefixIndex``: ``InProcessPrefixIndex`` (one router, no Redis) and
``RedisPrefixIndex`` (several routers and workers sharing one Redis; ``match`` is one round trip
through a server-side Lua script). Torch-free: the router imports it.
"""

from __future__ import annotations

import abc
import enum
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import cast

import redis.asyncio as aioredis

from engine.block_hash import BlockHash
from engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVMedium
from services.common import kv_event_stream
from services.common.kv_event_stream import STREAM_APPEND_LUA, StreamOp
from services.common.redis_config import RedisConfig


class PrefixIndex(abc.ABC):
    """``worker_id`` -> the block hashes it caches, plus liveness by heartbeat TTL."""

    @abc.abstractmethod
    async def store(
        self,
        worker_id: str,
        block_hashes: Sequence[BlockHash],
        medium: KVMedium = KVMedium.CACHE,
    ) -> None:
        """``worker_id`` now holds ``block_hashes`` in ``medium`` (idempotent; a block stored
        in the other medium before moved)."""

    @abc.abstractmethod
    async def remove(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """``worker_id`` no longer holds ``block_hashes``; unknown hashes are ignored."""

    @abc.abstractmethod
    async def clear(self, worker_id: str) -> None:
        """``worker_id`` holds nothing (its cache was reset, or it went away)."""

    @abc.abstractmethod
    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        """``worker_id`` is live for ``ttl_s`` more seconds. False when it was not live just
        before (first heartbeat, a lapse, or a Redis that restarted empty): the worker must
        then publish its whole cache again."""

    @abc.abstractmethod
    async def forget(self, worker_id: str) -> None:
        """``worker_id`` is gone for good (drained, shut down): drop its entries and liveness."""

    @abc.abstractmethod
    async def reap(self) -> list[str]:
        """Drop the entries of every worker without a live heartbeat (it died without
        ``forget``); return their ids. Idempotent: any number of routers may run it."""

    async def retain(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """``worker_id`` holds exactly ``block_hashes`` among its entries: drop the others
        (blocks predicted for prefills that never ran, events lost to a lapse)."""
        await self.remove(worker_id, list(set(await self.entries(worker_id)) - set(block_hashes)))

    @abc.abstractmethod
    async def entries(self, worker_id: str) -> list[BlockHash]:
        """The block hashes the index has for ``worker_id``."""

    @abc.abstractmethod
    async def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each live worker holding at least the first block: how many leading blocks of
        ``block_hashes`` it holds. Workers with no match or no live heartbeat are left out."""

    async def apply(self, worker_id: str, events: Sequence[KVCacheEvent]) -> None:
        """Apply a worker's cache events in order."""
        for event in events:
            if isinstance(event, BlockStored):
                await self.store(worker_id, event.block_hashes, event.medium)
            elif isinstance(event, BlockRemoved):
                await self.remove(worker_id, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                await self.clear(worker_id)

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections; the index's contents stay where they are."""


class InProcessPrefixIndex(PrefixIndex):
    """The index in this process's memory: for a single router without Redis.

    Bounded: it keeps the ``max_blocks`` most recently stored or matched block hashes (a router
    without Redis only learns predictions, one per routed prompt block, and nothing removes
    them; a prefix that keeps matching stays).
    """

    def __init__(self, max_blocks: int = 2**18) -> None:
        self.max_blocks = max_blocks
        # Least recently stored first.
        self._holders: OrderedDict[BlockHash, set[str]] = OrderedDict()
        self._entries = BlockHolders(self._holders)
        self._alive_until_s: dict[str, float] = {}

    async def store(
        self,
        worker_id: str,
        block_hashes: Sequence[BlockHash],
        medium: KVMedium = KVMedium.CACHE,
    ) -> None:
        self._entries.store(worker_id, block_hashes, medium)
        for block_hash in block_hashes:
            self._holders.move_to_end(block_hash)
        while len(self._holders) > self.max_blocks:
            block_hash, holders = self._holders.popitem(last=False)
            for holder in holders:
                self._entries.blocks[holder].discard(block_hash)
                self._entries.tier.get(holder, set()).discard(block_hash)

    async def remove(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        self._entries.remove(worker_id, block_hashes)

    async def clear(self, worker_id: str) -> None:
        self._entries.clear(worker_id)

    async def forget(self, worker_id: str) -> None:
        await self.clear(worker_id)
        self._alive_until_s.pop(worker_id, None)

    async def reap(self) -> list[str]:
        now_s = time.monotonic()
        dead = [w for w in self._entries.blocks if self._alive_until_s.get(w, 0.0) <= now_s]
        for worker_id in dead:
            await self.forget(worker_id)
        return dead

    async def entries(self, worker_id: str) -> list[BlockHash]:
        return list(self._entries.blocks.get(worker_id, ()))

    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        now_s = time.monotonic()
        was_live = self._alive_until_s.get(worker_id, 0.0) > now_s
        self._alive_until_s[worker_id] = now_s + ttl_s
        return was_live

    async def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        now_s = time.monotonic()
        counts = match_holders(self._holders, block_hashes)
        for block_hash in block_hashes[: max(counts.values(), default=0)]:
            self._holders.move_to_end(block_hash)
        return {w: n for w, n in counts.items() if self._alive_until_s.get(w, 0.0) > now_s}

    def tier_blocks(
        self, block_hashes: Sequence[BlockHash], matched: Mapping[str, int]
    ) -> dict[str, int]:
        """``BlockHolders.tier_blocks``: of each worker's ``matched`` blocks, those in its tier
        alone (what the Redis select script counts)."""
        return self._entries.tier_blocks(block_hashes, matched)

    async def close(self) -> None:
        """Nothing to release."""


class BlockHolders:
    """Which workers hold which blocks, both ways (block -> holders, worker -> blocks), and
    which of a worker's blocks are in its tier alone, as the Redis index keeps them: for the
    in-process index and a router's replica of the Redis one. ``holders`` may be given (an
    ``OrderedDict`` whose order its owner keeps). Invariant: ``tier[w] <= blocks[w]``."""

    __slots__ = ("blocks", "holders", "tier")

    def __init__(self, holders: dict[BlockHash, set[str]] | None = None) -> None:
        self.holders: dict[BlockHash, set[str]] = {} if holders is None else holders
        self.blocks: dict[str, set[BlockHash]] = {}
        self.tier: dict[str, set[BlockHash]] = {}

    def store(
        self,
        worker_id: str,
        block_hashes: Iterable[BlockHash],
        medium: KVMedium = KVMedium.CACHE,
    ) -> None:
        blocks = self.blocks.setdefault(worker_id, set())
        block_hashes = list(block_hashes)
        for block_hash in block_hashes:
            holders = self.holders.get(block_hash)
            if holders is None:
                holders = self.holders[block_hash] = set()
            holders.add(worker_id)
            blocks.add(block_hash)
        if medium is KVMedium.TIER:
            self.tier.setdefault(worker_id, set()).update(block_hashes)
        elif tier := self.tier.get(worker_id):
            tier.difference_update(block_hashes)

    def tier_blocks(
        self, block_hashes: Sequence[BlockHash], matched: Mapping[str, int]
    ) -> dict[str, int]:
        """For each worker of ``matched`` (worker id -> leading blocks of ``block_hashes`` it
        holds) whose tier holds any of them: how many."""
        counts = {}
        for worker_id, num_blocks in matched.items():
            tier = self.tier.get(worker_id)
            if tier and (n := sum(h in tier for h in block_hashes[:num_blocks])):
                counts[worker_id] = n
        return counts

    def remove(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        """Unknown hashes are ignored."""
        blocks = self.blocks.get(worker_id, set())
        tier = self.tier.get(worker_id, set())
        for block_hash in block_hashes:
            tier.discard(block_hash)
            blocks.discard(block_hash)
            holders = self.holders.get(block_hash)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self.holders[block_hash]

    def clear(self, worker_id: str) -> None:
        self.remove(worker_id, self.blocks.pop(worker_id, set()))
        self.tier.pop(worker_id, None)


def match_holders(
    holders: Mapping[BlockHash, AbstractSet[str]], block_hashes: Sequence[BlockHash]
) -> dict[str, int]:
    """For each worker in ``holders`` of the first block: how many leading blocks of
    ``block_hashes`` it holds (the walk ``match_prefix`` does in Redis, in this process)."""
    counts: dict[str, int] = {}
    active: set[str] = set()
    for i, block_hash in enumerate(block_hashes):
        held = holders.get(block_hash, _NO_HOLDERS)
        if i == 0:
            active = set(held)
        elif not active <= held:  # those not holding block i hold exactly i blocks
            kept = active & held
            for worker_id in active - kept:
                counts[worker_id] = i
            active = kept
        if not active:
            break
    for worker_id in active:  # they hold every block
        counts[worker_id] = len(block_hashes)
    return counts


_NO_HOLDERS: frozenset[str] = frozenset()


# Lua functions shared by the scripts that match prompts (``match`` here, the router's
# select-and-reserve). ``split_hashes`` cuts concatenated block hashes (sha256: 32 bytes each)
# apart; ``match_prefix(ns, hashes)`` walks them in prompt order and returns
# {worker_id = leading blocks held} for live workers holding at least the first;
# ``tier_count(ns, worker, hashes, n)`` counts the first ``n`` that are in the worker's tier alone.
MATCH_PREFIX_LUA = """
local function split_hashes(blob)
  local hashes = {}
  for i = 1, #blob, 32 do hashes[#hashes + 1] = string.sub(blob, i, i + 31) end
  return hashes
end

local function match_prefix(ns, hashes)
  local counts = {}
  local active = nil
  for i, block_hash in ipairs(hashes) do
    local holders = redis.call('SMEMBERS', ns .. 'blk:' .. block_hash)
    local next_active = {}
    local any = false
    for _, worker in ipairs(holders) do
      if active == nil or active[worker] then
        next_active[worker] = true
        counts[worker] = i
        any = true
      end
    end
    if not any then break end
    active = next_active
  end
  local live = {}
  for worker, count in pairs(counts) do
    if redis.call('EXISTS', ns .. 'alive:' .. worker) == 1 then live[worker] = count end
  end
  return live
end

local function tier_count(ns, worker, hashes, n)
  local key = ns .. 'tier:' .. worker
  if n == 0 or redis.call('EXISTS', key) == 0 then return 0 end
  local count = 0
  for i = 1, n, 1000 do
    for _, held in ipairs(redis.call('SMISMEMBER', key, unpack(hashes, i, math.min(i + 999, n)))) do
      count = count + held
    end
  end
  return count
end
"""

# KEYS: none (every key shares ARGV[1], the namespace; a single Redis, not a cluster).
# ARGV[1] = namespace prefix, ARGV[2] = the block hashes in prompt order, concatenated (32 bytes
# each: one argument instead of one per block keeps the call cheap to encode).
_MATCH_SCRIPT = (
    MATCH_PREFIX_LUA
    + """
local out = {}
for worker, count in pairs(match_prefix(ARGV[1], split_hashes(ARGV[2]))) do
  table.insert(out, worker)
  table.insert(out, count)
end
return out
"""
)


# ARGV: 1 namespace, 2 worker id, 3 change stream length (0: off). Drops every entry of the
# worker, atomically (so that no write lands between reading its entries and removing them).
_CLEAR_SCRIPT = (
    STREAM_APPEND_LUA
    + """
local ns, worker = ARGV[1], ARGV[2]
local key = ns .. 'worker:' .. worker
for _, block_hash in ipairs(redis.call('SMEMBERS', key)) do
  redis.call('SREM', ns .. 'blk:' .. block_hash, worker)
end
redis.call('DEL', key, ns .. 'tier:' .. worker)
stream_append(ns, tonumber(ARGV[3]), 'c', worker, '')
return 0
"""
)


class _SetOp(enum.Enum):
    """A Redis set command, by its name."""

    ADD = "sadd"
    REMOVE = "srem"


class RedisPrefixIndex(PrefixIndex):
    """The index in Redis, shared by every router and worker of one cluster (``namespace``).

    Layout: ``{ns}blk:{hash}`` = set of worker ids holding the block (the hash as its raw 32
    bytes: binary keys keep every lookup's arguments short); ``{ns}worker:{id}`` = set of the
    worker's hashes (to clear it); ``{ns}tier:{id}`` = the subset of those in its tier alone
    (absent for a worker without a tier); ``{ns}alive:{id}`` = a key whose TTL is the worker's
    heartbeat. Writes go in one pipeline per call; ``match`` is one ``EVALSHA``. With
    ``stream_max_len`` > 0 each write also appends its change to the change stream
    (``kv_event_stream``), in the same pipeline, after the change.
    """

    def __init__(
        self, client: aioredis.Redis, namespace: str = "splitserve:", stream_max_len: int = 0
    ) -> None:
        self._redis = client
        self._ns = namespace
        self._stream_max_len = stream_max_len
        self._blk = f"{namespace}blk:".encode()
        self._match = client.register_script(_MATCH_SCRIPT)
        self._clear = client.register_script(_CLEAR_SCRIPT)

    @classmethod
    def from_config(cls, config: RedisConfig) -> RedisPrefixIndex:
        return cls(config.client(), config.redis_namespace, config.redis_kv_event_stream_len)

    async def store(
        self,
        worker_id: str,
        block_hashes: Sequence[BlockHash],
        medium: KVMedium = KVMedium.CACHE,
    ) -> None:
        if medium is KVMedium.TIER:
            await self._update(_SetOp.ADD, worker_id, block_hashes, StreamOp.STORE_TIER)
        else:
            await self._update(_SetOp.ADD, worker_id, block_hashes, StreamOp.STORE)

    async def remove(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        await self._update(_SetOp.REMOVE, worker_id, block_hashes, StreamOp.REMOVE)

    async def clear(self, worker_id: str) -> None:
        await self._clear(args=[self._ns, worker_id, self._stream_max_len])

    async def forget(self, worker_id: str) -> None:
        await self.clear(worker_id)
        await self._redis.delete(f"{self._ns}alive:{worker_id}")

    async def reap(self) -> list[str]:
        prefix = f"{self._ns}worker:"
        worker_ids = [
            key.decode()[len(prefix) :] async for key in self._redis.scan_iter(f"{prefix}*")
        ]
        dead = []
        for worker_id in worker_ids:
            if not await self._redis.exists(f"{self._ns}alive:{worker_id}"):
                await self.clear(worker_id)
                dead.append(worker_id)
        return dead

    async def entries(self, worker_id: str) -> list[BlockHash]:
        # The client returns bytes (no decode_responses): block hashes are raw digests.
        members = cast(set[BlockHash], await self._redis.smembers(f"{self._ns}worker:{worker_id}"))
        return list(members)

    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        key = f"{self._ns}alive:{worker_id}"
        previous = await self._redis.set(key, b"1", px=max(int(ttl_s * 1e3), 1), get=True)
        return previous is not None

    async def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        if not block_hashes:
            return {}
        reply = await self._match(args=[self._ns, b"".join(block_hashes)])
        return {reply[i].decode(): int(reply[i + 1]) for i in range(0, len(reply), 2)}

    async def close(self) -> None:
        await self._redis.aclose()

    async def _update(
        self,
        op: _SetOp,
        worker_id: str,
        block_hashes: Sequence[BlockHash],
        stream_op: StreamOp,
    ) -> None:
        """Add ``worker_id`` to (or remove it from) each block's set, and the blocks to (from)
        the worker's own set and, for a store in the tier, to its tier set (from it, for any
        other change), in one round trip; with the change stream on, append ``stream_op`` in
        the same transaction, so that the stream orders changes as the sets took them."""
        if not block_hashes:
            return
        streamed = self._stream_max_len > 0
        async with self._redis.pipeline(transaction=streamed) as pipe:
            command = getattr(pipe, op.value)
            for block_hash in block_hashes:
                command(self._blk + block_hash, worker_id)
            command(f"{self._ns}worker:{worker_id}", *block_hashes)
            tier_key = f"{self._ns}tier:{worker_id}"
            if stream_op is StreamOp.STORE_TIER:
                pipe.sadd(tier_key, *block_hashes)
            else:
                pipe.srem(tier_key, *block_hashes)
            if streamed:
                kv_event_stream.append(
                    pipe, self._ns, self._stream_max_len, stream_op, worker_id, block_hashes
                )
            await pipe.execute()
