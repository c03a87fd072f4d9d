"""LoRA on the native engine: greedy output with an adapter equals transformers + PEFT with the
same adapter (random adapters on the tiny models, float32), alone and batched with other
adapters and with none; adapters never share KV blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from loadtest.fixtures.tiny_lora import ALL_TARGETS, make_tiny_lora
from tests.engine.test_generate_vs_hf import hf_generate, make_prompts

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
# name -> (rank, alpha, targets, rsLoRA): every projection; attention only at another rank and
# rsLoRA's scaling; the MLP only at the highest rank served.
ADAPTERS = {
    "all": (8, 16, ALL_TARGETS, False),
    "attn": (4, 8, ("q_proj", "v_proj"), True),
    "mlp": (16, 32, ("gate_proj", "up_proj", "down_proj"), False),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tiny_model_dirs, tmp_path_factory):
    """(model dir, adapter dirs, prompts, references[adapter or "" -> outputs per prompt])."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs[request.param]
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    dirs = {
        name: make_tiny_lora(
            model_dir, root / name, rank=r, alpha=a, targets=t, use_rslora=rs, seed=i
        )
        for i, (name, (r, a, t, rs)) in enumerate(ADAPTERS.items())
    }
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = make_prompts(base.config.vocab_size)[:6]
    references = {"": hf_generate(base, prompts, MAX_TOKENS)}
    for name, path in dirs.items():
        fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        references[name] = hf_generate(PeftModel.from_pretrained(fresh, path), prompts, MAX_TOKENS)
    return model_dir, dirs, prompts, references


def _llm(model_dir: Path, dirs: dict[str, Path], **kwargs) -> LLM:
    modules = ",".join(f"{name}={path}" for name, path in dirs.items())
    return LLM(
        str(model_dir),
        dtype="float32",
        num_kv_blocks=256,
        enable_lora=True,
        lora_modules=modules,
        max_loras=len(dirs),
        **kwargs,
    )


def test_adapters_change_the_output(case):
    """The references differ from the base model's: an adapter that did nothing would pass."""
    _, _, _, references = case
    for name in ADAPTERS:
        assert references[name] != references[""], name


@pytest.mark.parametrize("kernel_backend", ["auto", "torch"])
def test_each_adapter_alone_matches_peft(case, kernel_backend):
    model_dir, dirs, prompts, references = case
    llm = _llm(model_dir, dirs, kernel_backend=kernel_backend)
    for name in ["", *ADAPTERS]:
        for prompt, expected in zip(prompts, references[name], strict=True):
            (out,) = llm.generate([prompt], GREEDY, lora_name=name)
            assert out.token_ids == expected, (name, prompt)


def test_adapters_batched_together_match_peft(case):
    """Every prompt under every adapter and none, all in one batch (prefill and decode steps
    that mix four adapter groups)."""
    model_dir, dirs, prompts, references = case
    llm = _llm(model_dir, dirs)
    names = ["", *ADAPTERS]
    jobs = [(name, i) for i in range(len(prompts)) for name in names]
    outs = llm.generate([prompts[i] for _, i in jobs], GREEDY, lora_name=[name for name, _ in jobs])
    for (name, i), out in zip(jobs, outs, strict=True):
        assert out.token_ids == references[name][i], (name, i)


def test_an_adapter_never_hits_another_adapters_blocks(case):
    model_dir, dirs, prompts, _ = case
    llm = _llm(model_dir, dirs)
    prompt = prompts[-1]  # the longest: several full blocks
    block_size = llm.engine.config.block_size
    assert len(prompt) >= 2 * block_size
    first = llm.generate([prompt], GREEDY, lora_name="all")[0]
    assert first.num_cached_tokens == 0
    for name in ("attn", "mlp", ""):
        assert llm.generate([prompt], GREEDY, lora_name=name)[0].num_cached_tokens == 0, name
    again = llm.generate([prompt], GREEDY, lora_name="all")[0]
    assert again.num_cached_tokens >= block_size
