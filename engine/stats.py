"""``EngineStats``: a snapshot of one engine's load, for routing and the Status RPC."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's load, for routing and the Status RPC."""

    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    num_held_kv: int
    num_total_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_queued_prefill_tokens: int
    num_preemptions: int
    # Speculative decoding: draft tokens proposed and accepted since the engine started.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # The second KV tier (``--kv-offload-gib``): blocks it holds now, and since it opened the
    # blocks it stored, loaded back on prefix hits and refused on read (damaged files).
    num_tier_blocks: int = 0
    num_tier_stored_blocks: int = 0
    num_tier_hit_blocks: int = 0
    num_tier_refused_blocks: int = 0
    # Measured moving averages (0.0 until measured): seconds to load a block back from the
    # tier, and seconds of a prefilling step per token it scheduled.
    tier_load_s_per_block: float = 0.0
    prefill_s_per_token: float = 0.0

    @property
    def kv_usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks


def make_stats(
    scheduler: Scheduler, num_compiling: int = 0, prefill_s_per_token: float = 0.0
) -> EngineStats:
    """Snapshot ``scheduler`` and the block pool behind it. No side effects. Requests held
    outside the scheduler until their grammar compiles (``num_compiling``) count as waiting;
    ``prefill_s_per_token`` is the engine's measure of its steps."""
    pool = scheduler.kv_cache_manager.block_pool
    offload = scheduler.kv_cache_manager.offload
    stats = EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting) + num_compiling,
        num_waiting_for_kv=len(scheduler.waiting_for_remote_kv),
        num_held_kv=len(scheduler.held_kv),
        num_total_blocks=pool.num_blocks,
        num_used_blocks=pool.num_blocks - pool.num_free_blocks,
        num_cached_blocks=pool.num_cached_blocks,
        num_queued_prefill_tokens=scheduler.num_queued_prefill_tokens,
        num_preemptions=scheduler.num_preemptions,
        num_draft_tokens=scheduler.num_draft_tokens,
        num_accepted_draft_tokens=scheduler.num_accepted_tokens,
        prefill_s_per_token=prefill_s_per_token,
    )
    if offload is None:
        return stats
    counters = offload.tier.counters
    return dataclasses.replace(
        stats,
        num_tier_blocks=offload.tier.num_blocks,
        num_tier_stored_blocks=counters.num_stored,
        num_tier_hit_blocks=counters.num_hits,
        num_tier_refused_blocks=counters.num_refused,
        tier_load_s_per_block=offload.load_s_per_block.value,
    )
