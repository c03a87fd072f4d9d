"""The engine through the Triton kernels and captured decode steps, on CPU under Triton's
interpreter (the captures are the eager stand-in there; ``tests/gpu`` runs real CUDA graphs):
greedy output equals the torch reference path's token for token in float32 for every
architecture, through chunked prefill, prefix-cache hits, drafts and preemption, over
unquantized and 8-bit caches. Small shapes: the interpreter runs each kernel program in
Python."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from loadtest.fixtures.tiny_model import ARCHITECTURES
from tests.engine.test_speculative_decoding import OracleProposer

pytest.importorskip("triton")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
# Few sequences and a short context keep the captured sizes and the decode grid small.
SMALL = {"max_num_seqs": 4, "max_model_len": 128, "num_kv_blocks": 64, "dtype": "float32"}


def make_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 17, 40, 23)]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_triton_kernels_and_graphs_match_the_torch_path(tiny_model_dirs, arch):
    model_dir = str(tiny_model_dirs[arch])
    reference = LLM(model_dir, kernel_backend="torch", **SMALL)
    prompts = make_prompts(reference.engine.vocab_size)
    want = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    llm = LLM(model_dir, kernel_backend="triton", max_num_batched_tokens=24, **SMALL)
    # 4 sequences with 3 drafts each: up to 16 decode rows, buckets 1, 2, 4, 8, 16.
    assert llm.engine.kernels.describe().endswith(
        "decode=triton prefill=triton ops=triton graphs=5"
    )
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    if arch == "llama":  # again: every prompt's full blocks are prefix-cache hits now
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    captured = llm.engine.runner.captured_decode
    assert captured is not None and captured.graphs.num_replays > 0


def test_eager_triton_matches_the_torch_path(tiny_llama_dir):
    reference = LLM(str(tiny_llama_dir), kernel_backend="torch", **SMALL)
    prompts = make_prompts(reference.engine.vocab_size)
    want = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    llm = LLM(str(tiny_llama_dir), kernel_backend="triton", enforce_eager=True, **SMALL)
    assert llm.engine.runner.captured_decode is None
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_an_int8_cache_matches_the_torch_path(tiny_llama_dir):
    """(fp8 rows take the same paths with another decoding: the kernel tests cover it.)"""
    common = {**SMALL, "kv_cache_dtype": "int8"}
    reference = LLM(str(tiny_llama_dir), kernel_backend="torch", **common)
    prompts = make_prompts(reference.engine.vocab_size)
    want = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    llm = LLM(str(tiny_llama_dir), kernel_backend="triton", **common)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want


def test_drafts_and_preemption_in_captured_steps_keep_greedy_output(tiny_llama_dir):
    """Drafts accepted and rejected (a drafter that knows the answer, one draft in 2 wrong)
    in captured steps, with a pool too small for the batch (preemptions, recomputation) and
    prompts cut into chunks: the outputs are the eager reference's, every block comes back.
    The full checks of tests/engine/test_speculative_decoding.py run on CUDA in tests/gpu."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference_llm = LLM(str(tiny_llama_dir), kernel_backend="torch", **SMALL)
    prompts = make_prompts(reference_llm.engine.vocab_size)
    outputs = reference_llm.generate(prompts, params)
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, outputs, strict=True)}
    tight = {
        **SMALL,
        "max_model_len": 64,
        "num_kv_blocks": 5,
        "max_num_batched_tokens": 24,
        "check_kv_integrity": True,
    }
    llm = LLM(str(tiny_llama_dir), kernel_backend="triton", num_speculative_tokens=4, **tight)
    llm.engine.scheduler.proposer = OracleProposer(reference, wrong_every=2)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == [reference[tuple(p)] for p in prompts]
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
    captured = llm.engine.runner.captured_decode
    assert captured is not None and captured.graphs.num_replays > 0
    pool = llm.engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
