"""``RedisPrefillLedger``: the prefill ledger as one Lua script on Redis, shared by every router.

The whole decision (match the prompt, score the pool, pick and reserve, record the prompt's
blocks as the chosen worker's) is one script, so two routers deciding at once see each other's
reservations and spread a burst instead of herding onto the same worker. A reservation belongs
to its router's heartbeat key: when a router crashes, its reservations stop counting within
``router_ttl_s`` and are deleted by the next decision that meets them. ``prefill_ledger``
describes what a ledger decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis

from services.common import kv_event_stream
from services.common.background import BackgroundTasks
from services.common.kv_event_stream import STREAM_APPEND_LUA, StreamOp
from services.common.logs import rate_limited
from services.common.prefix_index import MATCH_PREFIX_LUA
from services.router.prefill_cost import (
    CandidateLoad,
    score_candidates,
)
from services.router.prefill_ledger import (
    RESERVATION_MAX_S,
    PrefillLedger,
    PrefillQuery,
    Reservation,
    Selection,
    reservation_member,
)

logger = logging.getLogger(__name__)

# ARGV: 1 namespace, 2 router id, 3 req id ('' = reserve nothing), 4 router ttl ms,
# 5 reservation max ms, 6 cache weight, 7 load weight, 8 load bound, 9 load bound slack,
# 10 saturation blocks, 11 tie value, 12 change stream length (0: off), 13 n candidates, then
# n x (worker id, reported queued blocks, tier load cost), then the prompt's block hashes
# concatenated (32 bytes each), then optionally n known matched-block counts and n known
# tier-block counts, one each per candidate (the prompt is then not matched here).
# Returns {chosen (1-based, 0: none), n x (matched, tier, reserved blocks, reserved requests),
# then (worker id, matched, tier) for matched workers that are not candidates}.
# Mirrors prefill_cost.score_candidates and pick operation for operation.
_SELECT_SCRIPT = (
    MATCH_PREFIX_LUA
    + STREAM_APPEND_LUA
    + """
local ns, router, req = ARGV[1], ARGV[2], ARGV[3]
local cache_w, load_w = tonumber(ARGV[6]), tonumber(ARGV[7])
local bound, slack = tonumber(ARGV[8]), tonumber(ARGV[9])
local saturation, tie = tonumber(ARGV[10]), tonumber(ARGV[11])
local stream_len, n = tonumber(ARGV[12]), tonumber(ARGV[13])
local hashes = split_hashes(ARGV[14 + 3 * n])
local prompt_blocks = #hashes
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('SET', ns .. 'router:' .. router, '1', 'PX', ARGV[4])
local matched, tier = {}, {}
if #ARGV > 14 + 3 * n then
  for i = 1, n do
    matched[ARGV[11 + 3 * i]] = tonumber(ARGV[14 + 3 * n + i])
    tier[ARGV[11 + 3 * i]] = tonumber(ARGV[14 + 4 * n + i])
  end
elseif prompt_blocks > 0 then
  matched = match_prefix(ns, hashes)
  for worker, count in pairs(matched) do tier[worker] = tier_count(ns, worker, hashes, count) end
end
local alive, ids, m, tm, rblocks, rreqs, total = {}, {}, {}, {}, {}, {}, 0
for i = 1, n do
  ids[i] = ARGV[11 + 3 * i]
  m[i] = matched[ids[i]] or 0
  tm[i] = math.min(tier[ids[i]] or 0, m[i])
  local key = ns .. 'resv:' .. ids[i]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms)
  local blocks, reqs = 0, 0
  for _, member in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    local owner, count = string.match(member, '^([^|]*)|.*|(%d+)$')
    if alive[owner] == nil then
      alive[owner] = redis.call('EXISTS', ns .. 'router:' .. owner) == 1
    end
    if alive[owner] then
      blocks = blocks + tonumber(count)
      reqs = reqs + 1
    else
      redis.call('ZREM', key, member)
    end
  end
  rblocks[i], rreqs[i], total = blocks, reqs, total + reqs
end
local capacity = math.huge
if bound > 0 and n > 0 then capacity = math.max(math.ceil(bound * (total + 1) / n), slack) end
local cost, eligible = {}, {}
local saturated = n > 0 and saturation > 0
for i = 1, n do
  local queued = math.max(tonumber(ARGV[12 + 3 * i]), rblocks[i])
  local uncached = prompt_blocks - m[i] + tm[i] * tonumber(ARGV[13 + 3 * i])
  cost[i] = cache_w * uncached + load_w * queued
  eligible[i] = rreqs[i] + 1 <= capacity
  if queued < saturation then saturated = false end
end
local chosen = 0
if n > 0 and not saturated then
  local best = nil
  for i = 1, n do
    if eligible[i] and (best == nil or cost[i] < best) then best = cost[i] end
  end
  local tied = {}
  for i = 1, n do
    if eligible[i] and cost[i] == best then table.insert(tied, i) end
  end
  local k = math.min(math.floor(tie * #tied), #tied - 1) + 1
  chosen = tied[k]
  if req ~= '' then
    local worker = ids[chosen]
    local member = router .. '|' .. req .. '|' .. (prompt_blocks - m[chosen])
    redis.call('ZADD', ns .. 'resv:' .. worker, now_ms + tonumber(ARGV[5]), member)
    for i = m[chosen] + 1, prompt_blocks do
      redis.call('SADD', ns .. 'blk:' .. hashes[i], worker)
    end
    for i = m[chosen] + 1, prompt_blocks, 1000 do
      local last = math.min(i + 999, prompt_blocks)
      redis.call('SADD', ns .. 'worker:' .. worker, unpack(hashes, i, last))
    end
    if m[chosen] < prompt_blocks then
      stream_append(ns, stream_len, 's', worker, string.sub(ARGV[14 + 3 * n], 32 * m[chosen] + 1))
    end
  end
end
local out = {chosen}
local is_candidate = {}
for i = 1, n do
  table.insert(out, m[i])
  table.insert(out, tm[i])
  table.insert(out, rblocks[i])
  table.insert(out, rreqs[i])
  is_candidate[ids[i]] = true
end
for worker, count in pairs(matched) do
  if not is_candidate[worker] then
    table.insert(out, worker)
    table.insert(out, count)
    table.insert(out, tier[worker] or 0)
  end
end
return out
"""
)

# ARGV: 1 namespace, 2 member prefix (router|req|), 3.. worker ids. Drops the matching members.
_ABANDON_SCRIPT = """
for i = 3, #ARGV do
  local key = ARGV[1] .. 'resv:' .. ARGV[i]
  for _, member in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    if string.sub(member, 1, #ARGV[2]) == ARGV[2] then redis.call('ZREM', key, member) end
  end
end
return 0
"""


class RedisPrefillLedger(PrefillLedger):
    """The ledger in Redis, shared by every router of a cluster (``namespace``).

    Keys: ``{ns}resv:{worker_id}`` = sorted set of reservations (member ``router|req|blocks``,
    score = hard expiry in ms); ``{ns}router:{router_id}`` = the router's heartbeat. The prefix
    index (``{ns}blk:*``, ``{ns}alive:*``) is read in the same script; with ``stream_max_len``
    > 0 a recorded prediction and a withdrawal are appended to its change stream too.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        router_id: str,
        router_ttl_s: float,
        namespace: str = "splitserve:",
        stream_max_len: int = 0,
    ) -> None:
        if "|" in router_id:
            raise ValueError(f"router id must not contain '|': {router_id!r}")
        self._redis = client
        self._router_id = router_id
        self._router_ttl_ms = max(int(router_ttl_s * 1e3), 1)
        self._ns = namespace
        self._stream_max_len = stream_max_len
        self._select = client.register_script(_SELECT_SCRIPT)
        self._abandon = client.register_script(_ABANDON_SCRIPT)
        self._background = BackgroundTasks()
        self._heartbeat: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Heartbeat the router's key every third of its TTL (on the running loop)."""
        self._heartbeat = asyncio.get_running_loop().create_task(self._heartbeat_forever())

    async def select(self, req_id: str | None, query: PrefillQuery) -> Selection:
        weights, candidates = query.weights, query.candidates
        args: list[str | bytes | float | int] = [
            self._ns,
            self._router_id,
            req_id or "",
            self._router_ttl_ms,
            int(RESERVATION_MAX_S * 1e3),
            weights.cache_weight,
            weights.load_weight,
            weights.load_bound,
            weights.load_bound_slack,
            weights.saturation_blocks,
            query.tie_value,
            self._stream_max_len,
            len(candidates),
        ]
        for candidate in candidates:
            args += [
                candidate.worker_id,
                candidate.reported_queued_blocks,
                candidate.tier_load_cost,
            ]
        args.append(b"".join(query.block_hashes))
        if query.matched is not None:
            args += [query.matched.get(c.worker_id, 0) for c in candidates]
            args += [query.tier_matched.get(c.worker_id, 0) for c in candidates]
        try:
            reply = await self._select(args=args)
        except asyncio.CancelledError:
            # The script may have run: drop whatever it reserved for this request.
            if req_id is not None:
                self._background.spawn(self._abandon_reservation(req_id, candidates))
            raise
        return self._selection(req_id, query, reply)

    async def release(self, reservation: Reservation) -> None:
        await self._redis.zrem(f"{self._ns}resv:{reservation.worker_id}", reservation.member)

    async def withdraw(self, reservation: Reservation) -> None:
        worker_id = reservation.worker_id
        blk = f"{self._ns}blk:".encode()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.zrem(f"{self._ns}resv:{worker_id}", reservation.member)
            for block_hash in reservation.recorded:
                pipe.srem(blk + block_hash, worker_id)
            if reservation.recorded:
                pipe.srem(f"{self._ns}worker:{worker_id}", *reservation.recorded)
                if self._stream_max_len > 0:
                    kv_event_stream.append(
                        pipe,
                        self._ns,
                        self._stream_max_len,
                        StreamOp.REMOVE,
                        worker_id,
                        reservation.recorded,
                    )
            await pipe.execute()

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        with contextlib.suppress(Exception):
            await self._redis.delete(f"{self._ns}router:{self._router_id}")
        await self._redis.aclose()

    def _selection(self, req_id: str | None, query: PrefillQuery, reply: list) -> Selection:
        block_hashes, candidates = query.block_hashes, query.candidates
        n = len(candidates)
        matched = {c.worker_id: int(reply[1 + 4 * i]) for i, c in enumerate(candidates)}
        tier = {c.worker_id: int(reply[2 + 4 * i]) for i, c in enumerate(candidates)}
        rest = reply[1 + 4 * n :]
        for i in range(0, len(rest), 3):
            worker_id = rest[i].decode()
            matched[worker_id], tier[worker_id] = int(rest[i + 1]), int(rest[i + 2])
        if query.matched is not None:  # the script saw the candidates' counts alone
            matched.update(query.matched)
            tier.update(query.tier_matched)
        scores = score_candidates(
            len(block_hashes),
            candidates,
            matched,
            [int(reply[3 + 4 * i]) for i in range(n)],
            [int(reply[4 + 4 * i]) for i in range(n)],
            query.weights,
            tier,
        )
        chosen = int(reply[0]) - 1 if int(reply[0]) > 0 else None
        reservation = None
        if chosen is not None and req_id is not None:
            matched_blocks = scores[chosen].matched_blocks
            blocks = len(block_hashes) - matched_blocks
            member = reservation_member(self._router_id, req_id, blocks)
            recorded = tuple(block_hashes[matched_blocks:])
            reservation = Reservation(candidates[chosen].worker_id, member, blocks, recorded)
        return Selection(
            scores,
            chosen,
            {w: c for w, c in matched.items() if c},
            reservation,
            {w: c for w, c in tier.items() if c},
        )

    async def _abandon_reservation(self, req_id: str, candidates: Sequence[CandidateLoad]) -> None:
        prefix = reservation_member(self._router_id, req_id, 0)[:-1]
        try:
            await self._abandon(args=[self._ns, prefix, *(c.worker_id for c in candidates)])
        except Exception as exc:  # it still ends with the router's heartbeat or its max age
            logger.warning(
                "req_id=%s could not drop its reservation: %r",
                req_id,
                exc,
                extra=rate_limited("redis"),
            )

    async def _heartbeat_forever(self) -> None:
        key = f"{self._ns}router:{self._router_id}"
        while True:
            try:
                await self._redis.set(key, b"1", px=self._router_ttl_ms)
            except Exception as exc:  # selections report Redis trouble; keep trying
                logger.debug("router heartbeat failed: %r", exc)
            await asyncio.sleep(self._router_ttl_ms / 3e3)
