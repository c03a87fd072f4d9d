"""A prefix pulled from a peer's cache instead of computed: two real engines, each with the
``KVHooks`` a worker runs, over a real ``tcp`` backend.

The source caches a conversation's history; the reader gets the next turn (history + new
tokens) with the prefix the source pinned (``LeaseHooks.pin``) and pulls it. Its tokens must be
those of the offline engine computing the whole prompt; a source that is gone (before or while
the reader reads) costs a recompute with the same tokens; a pin never crosses salts.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.block_hash import hash_block_tokens
from engine.outputs import RequestOutput
from engine.scheduler import DuplicateRequestError
from kvtransfer._pull_protocol import PullEndpoint
from kvtransfer.base import KVRef, PeerInfo
from kvtransfer.tcp import TcpBackend
from services.worker.kv_hooks import KVHooks
from services.worker.kv_leases import MAX_PIN_TTL_FACTOR
from tests.waiting import wait_until

BLOCK_SIZE = 16
WAIT_S = 60.0
HISTORY_TOKENS = 5 * BLOCK_SIZE + 7  # five full blocks and a partial one
NEW_TOKENS = 21
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
_IDS = itertools.count()


@dataclasses.dataclass
class Worker:
    """An engine and the KV hooks around its steps, as a worker's engine loop runs them."""

    engine: LLMEngine
    backend: TcpBackend
    peer: PeerInfo
    hooks: KVHooks

    def run(
        self,
        req_id: str,
        prompt: list[int],
        params: SamplingParams = GREEDY,
        *,
        src: KVRef | None = None,
        src_peer: PeerInfo | None = None,
        cache_salt: str = "",
        on_first_step: Callable[[], None] | None = None,
    ) -> RequestOutput:
        """Run ``prompt`` to its end, pulling ``src`` first when given (as the prefill server
        does with a ``peer_kv_ref``)."""
        num_external_tokens = 0
        if (
            src is not None
            and src_peer is not None
            and self.hooks.puller.expect(req_id, src, src_peer)
        ):
            num_external_tokens = src.num_tokens
        self.engine.add_request(
            req_id,
            prompt,
            params,
            num_external_tokens=num_external_tokens,
            cache_salt=cache_salt,
        )
        final: list[RequestOutput] = []
        first_step = [True]

        def finished() -> bool:
            self.hooks.before_step(self.engine)
            outputs = self.engine.step()
            self.hooks.after_step(self.engine, outputs)
            if first_step[0] and on_first_step is not None:
                on_first_step()
            first_step[0] = False
            final.extend(o for o in outputs if o.req_id == req_id and o.finished)
            return bool(final)

        wait_until(finished, WAIT_S, f"{req_id} finished", 0.001)
        self.engine.kv_cache_manager.check_integrity()
        return final[0]

    def pin(self, prompt: list[int], cache_salt: str = "") -> KVRef | None:
        """Lease the cached prefix of ``prompt`` for a peer (as ``PinPrefix`` does)."""
        pin_id = f"pin-{next(_IDS)}"
        max_blocks = (len(prompt) - 1) // BLOCK_SIZE
        lease = self.hooks.leases.pin(
            self.engine, pin_id, prompt, max_blocks, cache_salt=cache_salt, lora_name=""
        )
        if lease is None:
            return None
        num_tokens = len(lease.block_ids) * BLOCK_SIZE
        return KVRef(self.peer.engine_id, pin_id, lease.block_ids, num_tokens, lease.grant)

    def wait_released(self, pin_id: str) -> None:
        """Step the source's hooks until the reader's release freed the pinned blocks."""

        def freed() -> bool:
            self.hooks.before_step(self.engine)
            return not self.engine.holds_kv(pin_id)

        wait_until(freed, WAIT_S, f"{pin_id}'s blocks freed", 0.01)


def _worker(model_dir: Path, name: str, **engine_flags: object) -> Worker:
    flags: dict[str, object] = {"dtype": "float32", "num_kv_blocks": 64, **engine_flags}
    config = EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, **flags)  # type: ignore[arg-type]
    engine = LLMEngine(config)
    backend = TcpBackend(f"{name}-{next(_IDS)}", PullEndpoint(io_timeout_s=WAIT_S))
    peer = backend.register_kv_cache(engine.kv_cache, engine.kv_cache_spec)
    return Worker(engine, backend, peer, KVHooks(backend, lease_ttl_s=600.0))


@pytest.fixture
def source(tiny_llama_dir: Path) -> Iterator[Worker]:
    worker = _worker(tiny_llama_dir, "source")
    yield worker
    worker.backend.close()


@pytest.fixture
def reader(tiny_llama_dir: Path) -> Iterator[Worker]:
    worker = _worker(tiny_llama_dir, "reader")
    yield worker
    worker.backend.close()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)


def _turns(seed: int) -> tuple[list[int], list[int]]:
    """A conversation's history and its next turn (the history plus new tokens)."""
    rng = random.Random(seed)
    history = [rng.randrange(3, 480) for _ in range(HISTORY_TOKENS)]
    return history, history + [rng.randrange(3, 480) for _ in range(NEW_TOKENS)]


@pytest.mark.parametrize(
    "params",
    [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=8)],
    ids=["greedy", "seeded"],
)
def test_a_pulled_prefix_gives_the_tokens_of_computing_it(
    source: Worker, reader: Worker, offline: LLM, params: SamplingParams
) -> None:
    history, turn = _turns(0)
    source.run("history", history)
    src = source.pin(turn)
    assert src is not None and src.num_tokens == 5 * BLOCK_SIZE  # the full blocks it caches

    final = reader.run("turn", turn, params, src=src, src_peer=source.peer)

    assert final.token_ids == offline.generate([turn], params)[0].token_ids
    assert final.num_cached_tokens == src.num_tokens  # pulled, not computed
    pull = reader.hooks.puller.take_result("turn")
    assert pull is not None and not pull.failed and pull.num_transferred_blocks == 5
    source.wait_released(src.req_id)  # the reader's release ended the pin
    # The pulled blocks are the reader's own cache now: the next turn hits them.
    assert reader.engine.stats().num_cached_blocks >= 5


def test_a_reader_pulls_only_the_blocks_past_its_own_hits(
    source: Worker, reader: Worker, offline: LLM
) -> None:
    history, turn = _turns(1)
    source.run("history", history)
    reader.run("first-blocks", history[: 2 * BLOCK_SIZE + 1])  # caches two of the five
    src = source.pin(turn)
    assert src is not None

    final = reader.run("turn", turn, src=src, src_peer=source.peer)

    assert final.token_ids == offline.generate([turn], GREEDY)[0].token_ids
    pull = reader.hooks.puller.take_result("turn")
    assert pull is not None and pull.num_transferred_blocks == 3
    assert final.num_cached_tokens == 5 * BLOCK_SIZE


@pytest.mark.parametrize("when", ["before_the_read", "during_the_read"])
def test_a_dead_peer_costs_a_recompute_with_the_same_tokens(
    source: Worker, reader: Worker, offline: LLM, when: str
) -> None:
    history, turn = _turns(2)
    source.run("history", history)
    src = source.pin(turn)
    assert src is not None
    if when == "before_the_read":
        source.backend.close()

    final = reader.run(
        "turn",
        turn,
        src=src,
        src_peer=source.peer,
        on_first_step=source.backend.close if when == "during_the_read" else None,
    )

    assert final.token_ids == offline.generate([turn], GREEDY)[0].token_ids
    pull = reader.hooks.puller.take_result("turn")
    assert pull is not None
    if when == "before_the_read":
        assert pull.failed and final.num_cached_tokens == 0  # all of it computed here
    assert not reader.hooks.busy


def test_a_pin_holds_only_what_the_source_caches_under_that_salt(source: Worker) -> None:
    history, turn = _turns(3)
    source.run("history", history, cache_salt="tenant-a")
    assert source.pin(turn, cache_salt="tenant-b") is None
    assert source.pin(turn) is None  # unsalted: another key
    assert source.pin(_turns(4)[1], cache_salt="tenant-a") is None  # never cached
    assert source.engine.stats().num_held_kv == 0  # a pin of nothing holds nothing

    src = source.pin(turn, cache_salt="tenant-a")
    assert src is not None and len(src.block_ids) == 5
    with pytest.raises(DuplicateRequestError):
        source.hooks.leases.pin(
            source.engine, src.req_id, turn, 5, cache_salt="tenant-a", lora_name=""
        )
    assert source.hooks.leases.release(source.engine, src.req_id)
    source.wait_released(src.req_id)
    source.engine.kv_cache_manager.check_integrity()


def test_a_pin_waits_for_its_reader_as_asked_within_a_cap(source: Worker) -> None:
    history, turn = _turns(5)
    source.run("history", history)
    leases = source.hooks.leases
    asked = leases.pin(source.engine, "asked", turn, 5, cache_salt="", lora_name="", ttl_s=90.0)
    capped = leases.pin(source.engine, "capped", turn, 5, cache_salt="", lora_name="", ttl_s=1e9)
    default = leases.pin(source.engine, "default", turn, 5, cache_salt="", lora_name="")
    assert asked is not None and asked.ttl_s == 90.0
    assert capped is not None and capped.ttl_s == MAX_PIN_TTL_FACTOR * leases.ttl_s
    assert default is not None and default.ttl_s == leases.ttl_s
    # Three pins of one prefix share its blocks: each holds a reference.
    assert asked.block_ids == capped.block_ids == default.block_ids
    for pin_id in ("asked", "capped", "default"):
        assert leases.release(source.engine, pin_id)
        source.wait_released(pin_id)
    source.engine.kv_cache_manager.check_integrity()


def test_a_prefix_the_source_moved_to_its_tier_is_pulled_from_there(
    tiny_llama_dir: Path, reader: Worker, offline: LLM
) -> None:
    """A decode worker's cache soon evicts a conversation's reply; its second tier keeps it,
    and a pin loads it back for the peer instead of the peer computing it."""
    # 16 blocks of 16 tokens: the next two prompts push the history's blocks out to the tier.
    source = _worker(
        tiny_llama_dir, "tiered", num_kv_blocks=16, max_model_len=256, kv_offload_gib=0.05
    )
    try:
        history, turn = _turns(6)
        source.run("history", history)
        for i in range(2):
            source.run(f"evicts-{i}", _turns(10 + i)[0] + _turns(20 + i)[0])
        pool = source.engine.kv_cache_manager.block_pool
        hashes = hash_block_tokens(turn, BLOCK_SIZE)[:5]
        num_in_cache = sum(pool.get_cached_block(h) is not None for h in hashes)
        assert num_in_cache < 5  # evicted: some or all in the tier only
        tier_hits = source.engine.stats().num_tier_hit_blocks

        src = source.pin(turn)

        assert src is not None and src.num_tokens == 5 * BLOCK_SIZE
        assert source.engine.stats().num_tier_hit_blocks - tier_hits == 5 - num_in_cache

        final = reader.run("turn", turn, src=src, src_peer=source.peer)

        assert final.token_ids == offline.generate([turn], GREEDY)[0].token_ids
        assert final.num_cached_tokens == src.num_tokens
        source.wait_released(src.req_id)
        source.engine.kv_cache_manager.check_integrity()
    finally:
        source.backend.close()
