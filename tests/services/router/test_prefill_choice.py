"""``PrefillChooser`` in a pool larger than ``--prefill-max-candidates``: it scores the holders
of the prompt's prefix and a sample, in process and over a real Redis alike."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from services.common.prefix_index import InProcessPrefixIndex
from services.router.prefill_choice import PrefillChoice, PrefillChooser, sample_candidates
from services.router.prefill_cost import PrefillWeights
from services.router.prefill_ledger import LocalPrefillLedger
from tests.services.router.fakes import PREFILL, W, make_pool
from tests.services.router.test_prefill_ledger import chain, make_pair

NUM_WORKERS = 200
MAX_CANDIDATES = 16
WEIGHTS = PrefillWeights(load_bound=1.25)


def make_chooser(
    pool, ledger, local_index: InProcessPrefixIndex | None, seed: int
) -> PrefillChooser:
    return PrefillChooser(
        pool,
        ledger,
        local_index=local_index,
        weights=WEIGHTS,
        router_id="r1",
        rng=random.Random(seed),
        max_candidates=MAX_CANDIDATES,
    )


def test_sample_keeps_the_longest_holders_then_fills_with_others() -> None:
    ids = [f"w{i}" for i in range(100)]
    matched = {f"w{i}": 1 + i % 5 for i in range(0, 60, 3)}  # 20 holders, 1 to 5 blocks
    for seed in range(20):
        picked = sample_candidates(ids, matched, 8, random.Random(seed))
        assert picked == sorted(set(picked)) and len(picked) == 8
        holders = [ids[i] for i in picked if ids[i] in matched]
        longest = sorted(matched.values(), reverse=True)[:4]
        assert sorted((matched[w] for w in holders), reverse=True)[:4] == longest
    few = sample_candidates(ids, {"w5": 2, "w90": 7}, 8, random.Random(0))
    assert {5, 90} <= set(few) and len(few) == 8
    assert sample_candidates(ids[:5], {}, 8, random.Random(0)) == [0, 1, 2, 3, 4]


async def _decide_all(chooser: PrefillChooser, index_store, num: int) -> list[PrefillChoice]:
    """One prompt held (whole) by worker p137, then ``num`` fresh prompts nobody holds, none
    released: each decision's choice."""
    held = chain(seed=1, num_blocks=6)
    await index_store("p137", held)
    choices = [await chooser.choose("req-held", held)]
    for i in range(num):
        choices.append(await chooser.choose(f"req-{i}", chain(seed=100 + i, num_blocks=6)))
    return choices


def _check(choices: list[PrefillChoice]) -> None:
    first = choices[0]
    assert first.worker is not None and first.worker.address == "p137"
    assert first.matched_blocks == 6
    for choice in choices:
        assert len(choice.candidates) == MAX_CANDIDATES
        assert choice.worker is not None
        eligible = [c.score.cost for c in choice.candidates if c.score.eligible]
        chosen = next(c for c in choice.candidates if c.worker is choice.worker)
        assert chosen.score.cost == min(eligible)
    # Power of 16 choices over 200 idle workers: 241 prompts spread, none stacks up.
    spread = Counter(c.worker.address for c in choices if c.worker is not None)
    assert max(spread.values()) <= 3, spread.most_common(3)


@pytest.mark.parametrize("ledger_kind", ["inproc", "redis"])
def test_a_large_pool_scores_the_holder_and_a_sample(ledger_kind, redis_server) -> None:
    pool = make_pool(PREFILL, [W(f"p{i}") for i in range(NUM_WORKERS)])

    async def main() -> list[str | None]:
        if ledger_kind == "inproc":
            index = InProcessPrefixIndex()
            ledger = LocalPrefillLedger("r1", index)
            local_index: InProcessPrefixIndex | None = index
        else:
            index, ledger = await make_pair(redis_server.url)
            local_index = None

        async def store(worker_id: str, hashes) -> None:
            await index.store(worker_id, hashes)
            await index.heartbeat(worker_id, 3600)

        for i in range(NUM_WORKERS):
            await index.heartbeat(f"p{i}", 3600)
        choices = await _decide_all(make_chooser(pool, ledger, local_index, 3), store, 240)
        _check(choices)
        await ledger.close()
        return [None if c.worker is None else c.worker.address for c in choices]

    chosen = asyncio.run(main())
    # The same seed decides the same way in process and in Redis (the script mirrors Python).
    if ledger_kind == "redis":
        assert chosen == _inproc_reference(pool)


def _inproc_reference(pool) -> list[str | None]:
    async def main() -> list[str | None]:
        index = InProcessPrefixIndex()
        for i in range(NUM_WORKERS):
            await index.heartbeat(f"p{i}", 3600)
        chooser = make_chooser(pool, LocalPrefillLedger("r1", index), index, 3)
        choices = await _decide_all(chooser, index.store, 240)
        return [None if c.worker is None else c.worker.address for c in choices]

    return asyncio.run(main())


def test_a_pool_within_the_cap_is_scored_whole() -> None:
    pool = make_pool(PREFILL, [W(f"p{i}") for i in range(MAX_CANDIDATES)])

    async def main() -> PrefillChoice:
        index = InProcessPrefixIndex()
        chooser = make_chooser(pool, LocalPrefillLedger("r1", index), index, 0)
        return await chooser.choose("req", chain(seed=2, num_blocks=3))

    choice = asyncio.run(main())
    assert [c.worker.address for c in choice.candidates] == [w.address for w in pool.workers]
