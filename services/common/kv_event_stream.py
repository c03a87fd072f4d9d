"""The prefix index's change stream: every change to the Redis index, in order, for the routers
that keep their own replica of it (``services.router.prefix_replica``).

With ``--redis-kv-event-stream-len`` above 0, each writer of the Redis index (a worker's
``KVEventPublisher``, a router's decision recording its prediction, a withdrawal, a clear)
appends one entry per change to the stream ``{ns}kv-events`` after the change itself, trimmed
to about that many entries. A router then matches prompts in its own memory (as Dynamo's
routers do from their KV-event feed) instead of walking the index in Redis on every decision.

An entry's fields: ``o`` (``StreamOp``), ``w`` (the worker id) and ``h`` (the block hashes,
concatenated, 32 bytes each; empty for a clear).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from redis.asyncio.client import Pipeline

from engine.block_hash import BlockHash

HASH_BYTES = 32


class StreamOp(enum.Enum):
    """What one stream entry does to a worker's entries in the index."""

    STORE = b"s"  # into the worker's cache
    STORE_TIER = b"t"  # into the worker's tier alone
    REMOVE = b"r"
    CLEAR = b"c"


def stream_key(namespace: str) -> str:
    return f"{namespace}kv-events"


def append(
    pipe: Pipeline,
    namespace: str,
    max_len: int,
    op: StreamOp,
    worker_id: str,
    block_hashes: Sequence[BlockHash] = (),
) -> None:
    """Queue on ``pipe`` the entry for one change (after the change's own commands)."""
    fields = {b"o": op.value, b"w": worker_id.encode(), b"h": b"".join(block_hashes)}
    pipe.xadd(stream_key(namespace), fields, maxlen=max_len, approximate=True)  # type: ignore[arg-type]


def split_hashes(blob: bytes) -> list[BlockHash]:
    return [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


# Lua for a script that records a change: ``stream_append(ns, max_len, op, worker, blob)``
# appends its entry when the stream is on (``max_len`` > 0).
STREAM_APPEND_LUA = """
local function stream_append(ns, max_len, op, worker, blob)
  if max_len > 0 then
    redis.call('XADD', ns .. 'kv-events', 'MAXLEN', '~', max_len, '*',
      'o', op, 'w', worker, 'h', blob)
  end
end
"""
