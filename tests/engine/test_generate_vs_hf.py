"""Greedy decoding must match Hugging Face transformers token for token (float32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from loadtest.fixtures.tiny_model import ARCHITECTURES, make_tiny_model

PROMPT_LENS = (1, 5, 16, 17, 31, 48, 64, 97)
MAX_TOKENS = 12


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Reference: transformers generate(do_sample=False) in float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return hf_generate(model, prompts, max_tokens)


def hf_generate(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers ``generate(do_sample=False)`` of a loaded ``model`` (on its device), one
    prompt at a time, eos stops."""
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        with torch.no_grad():
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                pad_token_id=0,
            )
        outs.append(gen[0, len(prompt) :].tolist())
    return outs


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_case(request, tiny_model_dirs):
    model_dir = tiny_model_dirs[request.param]
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=256)
    prompts = make_prompts(llm.engine.vocab_size)
    return model_dir, llm, prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def test_each_prompt_alone_matches_hf(arch_case):
    _, llm, prompts, expected = arch_case
    for prompt, want in zip(prompts, expected, strict=True):
        assert llm.generate([prompt], GREEDY)[0].token_ids == want


def test_all_prompts_batched_match_hf(arch_case):
    _, llm, prompts, expected = arch_case
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == expected


def test_chunked_prefill_and_mixed_batches_match_hf(arch_case):
    model_dir, _, prompts, expected = arch_case
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == expected


def test_long_prefill_threshold_shares_steps_and_matches_hf(arch_case):
    """Capping each prompt's chunk lets every prompt start in the first step, and changes no
    token."""
    model_dir, _, prompts, expected = arch_case
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=256, long_prefill_token_threshold=8)
    req_ids = [f"probe-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(req_ids, prompts, strict=True):
        llm.engine.add_request(req_id, prompt, GREEDY)
    first = llm.engine.scheduler.schedule()
    assert len(first.scheduled) == len(prompts)
    assert max(item.num_new_tokens for item in first.scheduled) == 8
    llm.engine.abort_requests(req_ids)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == expected


def test_preemption_under_tiny_block_budget_matches_hf(arch_case):
    model_dir, _, prompts, expected = arch_case
    # 14 blocks x 16 tokens cannot hold all 8 requests at once: some must be preempted.
    llm = LLM(
        str(model_dir),
        dtype="float32",
        num_kv_blocks=14,
        max_model_len=14 * 16,
        enable_prefix_caching=False,
    )
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_bfloat16_runs_and_mostly_agrees(arch_case):
    """bf16 rounding may flip a late token; the first tokens must still agree with float32."""
    model_dir, _, prompts, expected = arch_case
    llm = LLM(str(model_dir), dtype="bfloat16", num_kv_blocks=256)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    agree = sum(g[:2] == e[:2] for g, e in zip(got, expected, strict=True))
    assert agree >= len(prompts) - 1


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_both_decode_backends_match_hf(arch_case, backend):
    """The pure-torch reference path and the default (compiled kernel on CPU) both match."""
    model_dir, _, prompts, expected = arch_case
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=256, kernel_backend=backend)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == expected


KERNEL_SHAPED_ARCHS = pytest.mark.parametrize(
    "arch,overrides",
    [("llama", {}), ("mistral", {"sliding_window": 24}), ("qwen2", {"num_key_value_heads": 1})],
)


def make_head_dim_64_model(root: Path, arch: str, overrides: dict[str, int]) -> Path:
    """A tiny model whose head_dim (64) the compiled prefill kernels are built for."""
    return make_tiny_model(
        root / arch,
        arch,
        hidden_size=256,
        intermediate_size=256,
        num_attention_heads=4,
        **({"num_key_value_heads": 2} | overrides),
    )


@KERNEL_SHAPED_ARCHS
def test_float32_cpu_kernels_match_hf(tmp_path, arch, overrides):
    """With head_dim 64 the compiled float32 prefill (AVX2 and up) and decode kernels run;
    chunked prefill over cached prefixes (a 24-token budget) and mixed steps must still be
    Hugging Face's greedy tokens, one for one."""
    model_dir = make_head_dim_64_model(tmp_path, arch, overrides)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24)
    if llm.engine.runner.prefill_kernel is None:
        pytest.skip("the float32 prefill kernel is built from avx2 up")
    prompts = make_prompts(llm.engine.vocab_size)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == hf_greedy(
        model_dir, prompts, MAX_TOKENS
    )


@KERNEL_SHAPED_ARCHS
def test_bfloat16_cpu_kernels_agree_with_torch_path(tmp_path, arch, overrides):
    """With head_dim 64 the compiled bfloat16 prefill and decode kernels run; chunked prefill
    over cached prefixes (a 24-token budget) and mixed steps must give what the SDPA + torch
    reference path gives, up to bf16 rounding flipping a late near-tie."""
    model_dir = make_head_dim_64_model(tmp_path, arch, overrides)
    outputs = {}
    for backend in ("torch", "auto"):
        llm = LLM(
            str(model_dir),
            dtype="bfloat16",
            kv_cache_dtype="bfloat16",  # the bf16 kernels (test_kv_cache_dtype: the 8-bit ones)
            num_kv_blocks=256,
            max_num_batched_tokens=24,
            kernel_backend=backend,
        )
        if backend == "auto" and llm.engine.runner.prefill_kernel is None:
            pytest.skip("no AVX-512 BF16 prefill kernel on this host")
        prompts = make_prompts(llm.engine.vocab_size)
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    agree = sum(a[:6] == b[:6] for a, b in zip(outputs["torch"], outputs["auto"], strict=True))
    assert agree >= len(PROMPT_LENS) - 1
