"""A router's own replica of the Redis prefix index, kept current from its change stream.

With a change stream (``--redis-kv-event-stream-len``; ``services.common.kv_event_stream``) a
router matches prompts here, in its own memory, instead of walking the index in Redis on every
decision: the decision's Redis work is then the reservation alone, and its cost no longer
grows with the prompt's length or the holders of its prefix.

The replica starts from a snapshot (each worker's set ``{ns}worker:{id}``) taken after noting
the stream's last id, then applies every entry after that id in order. Writers append to the
stream after changing the sets, so the snapshot and the entries replayed over it end where the
index is. Whenever it cannot be sure of that (Redis unreachable or restarted, entries trimmed
before it read them) it is not ``ready`` and takes a new snapshot; the router matches in Redis
meanwhile. Where two writers race on one block (a worker's event and a router's prediction),
the replica may keep the other order than the sets: that costs affinity, as any stale index
does, until the worker's next events or its reconciliation.

Liveness is not kept here: a worker's entries go when it is cleared (drained, restarted, reaped
by a router), and the routers' pools decide which workers are candidates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import cast

import redis.asyncio as aioredis

from engine.block_hash import BlockHash
from engine.block_pool import KVMedium
from services.common.kv_event_stream import StreamOp, split_hashes, stream_key
from services.common.logs import rate_limited
from services.common.prefix_index import BlockHolders, match_holders

logger = logging.getLogger(__name__)

# How long one read waits on the stream for new entries (within the client's 1 s socket timeout).
_READ_BLOCK_MS = 500
# Entries applied per read, at most.
_READ_COUNT = 1000
# The wait before another snapshot after a failure.
_RETRY_S = 0.5


class PrefixIndexReplica:
    """This router's copy of the Redis prefix index (``namespace``), following its stream.

    ``start`` begins following on the running loop; ``match`` answers from memory while
    ``ready``. ``note_prediction`` records this router's own decision at once (its stream entry
    comes back later and changes nothing).
    """

    def __init__(self, client: aioredis.Redis, namespace: str = "splitserve:") -> None:
        self._redis = client
        self._ns = namespace
        self._key = stream_key(namespace)
        # Made by the first replica after Redis starts: a restart loses it, so that a replica
        # whose connection survives the restart (the client's retries) still sees it.
        self._epoch_key = f"{namespace}kv-epoch"
        self._epoch: bytes | None = None
        self._entries = BlockHolders()
        self._last_id = b"0-0"
        # Entries of the stream that the replica holds: applied, or in its snapshot.
        self._num_consumed = 0
        self._ready = False
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.num_snapshots = 0

    @property
    def ready(self) -> bool:
        """Whether ``match`` answers for the index as it is (up to the stream's delay)."""
        return self._ready

    @property
    def last_id(self) -> bytes:
        """The id of the last stream entry applied."""
        return self._last_id

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each worker holding at least the first block: how many leading blocks of
        ``block_hashes`` it holds (no liveness filter: see the module's docstring)."""
        return match_holders(self._entries.holders, block_hashes)

    def tier_blocks(
        self, block_hashes: Sequence[BlockHash], matched: Mapping[str, int]
    ) -> dict[str, int]:
        """For each worker of ``matched`` (``match``'s answer for ``block_hashes``) whose tier
        alone holds some of its matched blocks: how many."""
        return self._entries.tier_blocks(block_hashes, matched)

    def note_prediction(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """This router recorded ``block_hashes`` as ``worker_id``'s (its decision's prediction)."""
        self._entries.store(worker_id, block_hashes)

    def note_withdrawal(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """This router withdrew a prediction of ``block_hashes`` on ``worker_id``."""
        self._entries.remove(worker_id, block_hashes)

    def start(self) -> None:
        """Snapshot and follow the stream in the background (on the running loop)."""
        self._task = asyncio.get_running_loop().create_task(self._follow_forever())

    async def close(self) -> None:
        """Stop following (within one read's wait) and close the client."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._redis.aclose()

    async def _follow_forever(self) -> None:
        # ``_closing`` as well as the cancellation: the client's read timeout can swallow a
        # cancellation that arrives with it (asyncio.timeout in Python 3.11).
        while not self._closing:
            try:
                await self._snapshot()
                while not self._closing and await self._read():
                    pass
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down or restarting: snapshot again once it is back
                logger.warning(
                    "prefix index stream unreadable (%r); matching in Redis until a new snapshot",
                    exc,
                    extra=rate_limited("redis"),
                )
            self._ready = False
            if not self._closing:
                await asyncio.sleep(_RETRY_S)

    async def _snapshot(self) -> None:
        """Take every worker's entries from Redis, after noting where the stream ends."""
        self._ready = False
        last_id, num_added = await self._stream_end()
        entries = BlockHolders()
        prefix = f"{self._ns}worker:"
        async for key in self._redis.scan_iter(f"{prefix}*", count=1000):
            worker_id = key.decode()[len(prefix) :]
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.smembers(key)
                pipe.smembers(f"{self._ns}tier:{worker_id}")
                blocks, tier = await pipe.execute()
            entries.store(worker_id, cast(set[BlockHash], blocks) - tier)
            entries.store(worker_id, cast(set[BlockHash], tier), KVMedium.TIER)
        self._entries, self._last_id, self._num_consumed = entries, last_id, num_added
        self._ready = True
        self.num_snapshots += 1

    async def _read(self) -> bool:
        """Apply the next entries (waiting a while for them). False: some were trimmed before
        they were read, or the stream was reset: take a new snapshot."""
        reply = cast(
            list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]],
            await self._redis.xread({self._key: self._last_id}, _READ_COUNT, _READ_BLOCK_MS),
        )
        if not await self._stream_intact():
            return False
        for entry_id, fields in reply[0][1] if reply else ():
            worker_id = fields[b"w"].decode()
            op = StreamOp(fields[b"o"])
            if op is StreamOp.STORE:
                self._entries.store(worker_id, split_hashes(fields[b"h"]))
            elif op is StreamOp.STORE_TIER:
                self._entries.store(worker_id, split_hashes(fields[b"h"]), KVMedium.TIER)
            elif op is StreamOp.REMOVE:
                self._entries.remove(worker_id, split_hashes(fields[b"h"]))
            else:
                self._entries.clear(worker_id)
            self._last_id = entry_id
            self._num_consumed += 1
        return True

    async def _stream_intact(self) -> bool:
        """Whether no entry after the last one applied was trimmed (no ``XDEL`` is ever used),
        and Redis is the one the snapshot came from (its epoch key, which a restart loses, is
        unchanged)."""
        info, epoch = await self._stream_state()
        if epoch != self._epoch:
            return False
        if info is None:  # no stream yet
            return self._num_consumed == 0
        # Trimming drops the oldest entries: those before the first left were all consumed.
        return int(info["entries-added"]) - int(info["length"]) <= self._num_consumed

    async def _stream_state(self) -> tuple[dict | None, bytes | None]:
        """The stream's ``XINFO STREAM`` (None: no stream) and the index's epoch key."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.xinfo_stream(self._key)
            pipe.get(self._epoch_key)
            info, epoch = await pipe.execute(raise_on_error=False)
        if isinstance(info, aioredis.ResponseError):
            info = None
        elif isinstance(info, Exception):
            raise info
        return info, epoch

    async def _stream_end(self) -> tuple[bytes, int]:
        """The id of the stream's last entry and the entries ever added to it; (re)makes the
        epoch key, noted as the snapshot's."""
        await self._redis.set(self._epoch_key, secrets.token_hex(8), nx=True)
        info, epoch = await self._stream_state()
        if epoch is None:
            raise ConnectionError("the prefix index's epoch key vanished")
        self._epoch = epoch
        if info is None:
            return b"0-0", 0
        last = info["last-generated-id"]
        return last if isinstance(last, bytes) else str(last).encode(), int(info["entries-added"])
