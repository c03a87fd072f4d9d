"""Prompt-lookup drafts on a CUDA device, where the verification rows run the torch decode path
one row per token: greedy output with drafts equals the output without them token for token
(float32 weights over a float32 cache and over an int8 one), with the real lookup and with a
drafter that knows the answer but gets one draft in 3 wrong; under preemption and chunked
prefill every block comes back. The checks are the CPU tests' (tests/engine/
test_speculative_decoding.py). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_speculative_decoding import (
    check_drafts_keep_greedy_output,
    check_drafts_under_preemption,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_greedy_output_on_the_device_is_the_same_with_and_without_drafts(
    tiny_llama_dir, kv_cache_dtype
):
    check_drafts_keep_greedy_output(
        tiny_llama_dir, device="cuda", dtype="float32", kv_cache_dtype=kv_cache_dtype
    )


def test_drafts_under_preemption_and_chunked_prefill_on_the_device(tiny_llama_dir):
    check_drafts_under_preemption(tiny_llama_dir, device="cuda")
