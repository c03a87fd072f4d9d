"""Prompt-lookup drafts on a CUDA device, where the verification rows run the torch decode path
one row per token: greedy output with drafts equals the output without them token for token
(float32 weights over a float32 cache and over an int8 one), with the real lookup and with a
drafter that knows the answer but gets one draft in 3 wrong; under preemption and chunked
prefill every block comes back. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.test_speculative_decoding import OracleProposer, generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_greedy_output_on_the_device_is_the_same_with_and_without_drafts(
    tiny_llama_dir, kv_cache_dtype
):
    common = {
        "device": "cuda",
        "dtype": "float32",
        "kv_cache_dtype": kv_cache_dtype,
        "num_kv_blocks": 256,
        "check_kv_integrity": True,
    }
    plain = LLM(str(tiny_llama_dir), num_speculative_tokens=0, **common)
    assert plain.engine.device.type == "cuda"
    reference = generate(plain, PARAMS)
    spec = LLM(str(tiny_llama_dir), num_speculative_tokens=4, **common)
    assert generate(spec, PARAMS) == reference
    assert spec.engine.scheduler.num_draft_tokens > 0
    oracle = LLM(str(tiny_llama_dir), num_speculative_tokens=4, **common)
    oracle.engine.scheduler.proposer = OracleProposer(reference, wrong_every=3)
    assert generate(oracle, PARAMS) == reference
    scheduler = oracle.engine.scheduler
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens


def test_drafts_under_preemption_and_chunked_prefill_on_the_device(tiny_llama_dir):
    common = {
        "device": "cuda",
        "dtype": "float32",
        "max_num_batched_tokens": 24,
        "max_model_len": 128,
        "check_kv_integrity": True,
    }
    plain = LLM(str(tiny_llama_dir), num_speculative_tokens=0, num_kv_blocks=256, **common)
    reference = generate(plain, PARAMS)
    tight = LLM(str(tiny_llama_dir), num_speculative_tokens=4, num_kv_blocks=10, **common)
    tight.engine.scheduler.proposer = OracleProposer(reference, wrong_every=2)
    assert generate(tight, PARAMS) == reference
    scheduler = tight.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.num_accepted_tokens > 0
    pool = tight.engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
