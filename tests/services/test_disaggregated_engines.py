"""Prefill engine → inproc KV transfer → decode engine, in one process, against the offline engine.

This drives the same hooks the workers run (``LeaseHooks`` on the prefill side, ``KVPullHooks``
on the decode side) step by step, without gRPC, so the KV handoff itself is checked exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.outputs import RequestOutput
from kvtransfer.base import KVRef
from kvtransfer.inproc import InprocBackend
from services.worker.kv_leases import LeaseHooks
from services.worker.kv_puller import KVPullHooks
from tests.waiting import wait_until

MAX_TOKENS = 10
POISON = 1e30
_ENGINE_IDS = itertools.count()


class Pair:
    """A prefill engine and a decode engine paired over the inproc backend."""

    def __init__(self, model_dir, lease_ttl_s: float = 30.0) -> None:
        config = EngineConfig(
            model=str(model_dir), dtype="float32", num_kv_blocks=128, detokenize=False
        )
        n = next(_ENGINE_IDS)
        self.prefill = LLMEngine(config)
        self.decode = LLMEngine(config)
        self.prefill_kv = InprocBackend(f"prefill-{n}")
        self.decode_kv = InprocBackend(f"decode-{n}")
        self.peer = self.prefill_kv.register_kv_cache(
            self.prefill.runner.kv_cache, self.prefill.runner.kv_cache_spec
        )
        self.decode_kv.register_kv_cache(
            self.decode.runner.kv_cache, self.decode.runner.kv_cache_spec
        )
        self.leases = LeaseHooks(self.prefill_kv, lease_ttl_s)
        self.puller = KVPullHooks(self.decode_kv)

    def close(self) -> None:
        self.prefill_kv.close()
        self.decode_kv.close()

    def run_prefill(self, req_id: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
        first = dataclasses.replace(params, max_tokens=1)
        self.prefill.add_request(req_id, prompt, first, hold_kv=True)
        final = None
        while self.prefill.has_unfinished_requests():
            outputs = self.prefill.step()
            self.leases.after_step(self.prefill, outputs)
            final = next((o for o in outputs if o.req_id == req_id), final)
        assert final is not None and final.finished
        return final

    def free_released_leases(self, timeout_s: float = 10.0) -> None:
        """Step the prefill side's hooks until released leases' blocks are free (unpublishing
        runs off the engine thread; a later ``before_step`` frees the blocks)."""

        def freed() -> bool:
            if not self.prefill.stats().num_held_kv:
                return True
            self.leases.before_step(self.prefill)
            return False

        wait_until(freed, timeout_s, "the released leases' blocks freed", 0.001)

    def kv_ref(self, req_id: str, num_tokens: int) -> KVRef:
        lease = self.leases.get(req_id)
        assert lease is not None
        return KVRef(self.peer.engine_id, req_id, lease.block_ids, num_tokens, lease.grant)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> dict[str, RequestOutput]:
        """Prefill every prompt, then decode them all as one batch; final outputs by req_id."""
        for i, prompt in enumerate(prompts):
            req_id = f"r{i}"
            first = self.run_prefill(req_id, prompt, params)
            assert self.puller.expect(req_id, self.kv_ref(req_id, len(prompt)), self.peer)
            self.decode.add_request(
                req_id,
                prompt,
                params,
                output_token_ids=first.token_ids,
                num_external_tokens=len(prompt),
            )
        finals: dict[str, RequestOutput] = {}
        while self.decode.has_unfinished_requests():
            self.puller.before_step(self.decode)
            outputs = self.decode.step()
            self.puller.after_step(self.decode, outputs)
            finals.update((o.req_id, o) for o in outputs if o.finished)
            self.leases.before_step(self.prefill)  # the source sees the releases
            self.decode.kv_cache_manager.check_integrity()
        return finals


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=128)


@pytest.fixture
def pair(tiny_llama_dir):
    pair = Pair(tiny_llama_dir)
    yield pair
    pair.close()


def make_prompts(seed: int = 0, lens=(1, 7, 16, 17, 40, 64)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 480) for _ in range(n)] for n in lens]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=3, max_tokens=MAX_TOKENS),
    ],
    ids=["greedy", "seeded-top-p", "seeded-penalty"],
)
def test_disaggregated_matches_offline(pair, offline, params):
    prompts = make_prompts()
    want = offline.generate(prompts, params)
    got = pair.generate(prompts, params)
    for i, expected in enumerate(want):
        assert got[f"r{i}"].token_ids == expected.token_ids, f"prompt {i}"
        assert got[f"r{i}"].num_cached_tokens == len(prompts[i])  # all of it arrived by transfer


def test_leases_end_when_decode_releases(pair):
    pair.generate(make_prompts(), SamplingParams(temperature=0.0, max_tokens=4))
    assert pair.leases.num_leases == 0
    pair.free_released_leases()
    stats = pair.prefill.stats()
    assert stats.num_held_kv == 0 and stats.num_used_blocks == 0
    assert pair.decode.stats().num_used_blocks == 0
    pair.prefill.kv_cache_manager.check_integrity()


def test_decode_pulls_only_blocks_missing_from_its_prefix_cache(pair):
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    shared = make_prompts(seed=1, lens=(48,))[0]  # three full blocks
    pair.generate([[*shared, 5, 6]], greedy)
    assert pair.puller.take_result("r0").num_transferred_blocks == 4  # 50 tokens: 4 blocks
    # A second request sharing the first 48 tokens: the decode side already caches 3 blocks.
    pair.generate([[*shared, *range(9, 26)]], greedy)
    result = pair.puller.take_result("r0")
    assert result is not None and not result.failed
    assert result.num_transferred_blocks == 2  # 65 tokens: 5 blocks, 3 local hits


def test_a_forged_grant_pulls_nothing_and_the_decode_side_computes_the_prompt(pair, offline):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompt = make_prompts(lens=(40,))[0]  # two full blocks and a partial one
    (want,) = offline.generate([prompt], params)
    first = pair.run_prefill("r0", prompt, params)
    real = pair.kv_ref("r0", len(prompt))
    forged = dataclasses.replace(real, grant=bytes([real.grant[0] ^ 0xFF]) + real.grant[1:])
    # Bytes no forward pass produces: a block that came from the source would show them.
    pair.prefill.kv_cache[list(real.block_ids)] = POISON
    assert pair.puller.expect("r0", forged, pair.peer)
    pair.decode.add_request(
        "r0", prompt, params, output_token_ids=first.token_ids, num_external_tokens=len(prompt)
    )
    cached_when_the_pull_ended = None
    final = None
    while pair.decode.has_unfinished_requests():
        pulling = pair.puller.busy
        pair.puller.before_step(pair.decode)
        if pulling and not pair.puller.busy:
            cached_when_the_pull_ended = list(pair.decode.prefix_cache_blocks())
        outputs = pair.decode.step()
        pair.puller.after_step(pair.decode, outputs)
        final = next((o for o in outputs if o.finished), final)
    result = pair.puller.take_result("r0")
    assert result is not None and result.failed and result.num_transferred_blocks == 0
    assert cached_when_the_pull_ended == []  # a pull that succeeded caches its blocks at once
    assert final is not None and final.token_ids == want.token_ids
    assert final.num_cached_tokens == 0  # every prompt token was computed here
    assert not (pair.decode.kv_cache == POISON).any()
    # The release that followed the failed pull presented the forged grant too: the lease stays.
    pair.leases.before_step(pair.prefill)
    assert pair.leases.num_leases == 1


def test_unpulled_lease_expires_and_frees_the_blocks(tiny_llama_dir):
    pair = Pair(tiny_llama_dir, lease_ttl_s=0.05)
    try:
        prompt = make_prompts(lens=(40,))[0]
        pair.run_prefill("r0", prompt, SamplingParams(temperature=0.0, max_tokens=5))
        grant = pair.kv_ref("r0", len(prompt)).grant
        assert pair.leases.num_leases == 1
        assert pair.prefill.stats().num_used_blocks == 3
        time.sleep(0.1)  # the 0.05 s TTL lapses (nothing else to wait for: the clock does it)
        pair.leases.before_step(pair.prefill)
        assert pair.leases.num_leases == 0 and pair.leases.num_leases_expired == 1
        pair.free_released_leases()
        assert pair.prefill.stats().num_used_blocks == 0
        # A pull that comes too late fails and the decode side recomputes the prompt.
        late_ref = KVRef(pair.peer.engine_id, "r0", (0, 1, 2), 40, grant)
        assert pair.puller.expect("r0", late_ref, pair.peer)
        pair.decode.add_request(
            "r0", prompt, SamplingParams(temperature=0.0, max_tokens=5), output_token_ids=[7],
            num_external_tokens=40,
        )  # fmt: skip
        while pair.decode.has_unfinished_requests():
            pair.puller.before_step(pair.decode)
            outputs = pair.decode.step()
            pair.puller.after_step(pair.decode, outputs)
        result = pair.puller.take_result("r0")
        assert result is not None and result.failed
        assert outputs[-1].finished and len(outputs[-1].token_ids) == 5
    finally:
        pair.close()


def test_releasing_a_finished_one_token_prefill_frees_its_blocks(pair):
    prompt = make_prompts(lens=(20,))[0]
    out = pair.run_prefill("r0", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    assert out.finish_reason == "length"
    # The prefill service releases at once when the client asked for one token.
    assert pair.leases.release(pair.prefill, "r0")
    pair.free_released_leases()
    assert pair.prefill.stats().num_used_blocks == 0
