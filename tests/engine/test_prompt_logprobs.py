"""Prompt logprobs (vLLM's ``prompt_logprobs``) equal transformers' log-softmax of the prompt's
logits (float32, 1e-4), whole or in chunked prefill, batched with other requests, and never
from a prefix-cache hit (the request computes its whole prompt)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

PROMPT_LENS = (2, 17, 40, 97)
NUM_TOP = 3


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _reference(hf_model, prompt: list[int]) -> torch.Tensor:
    """log P(prompt[i + 1] | prompt[: i + 1]) rows: [len - 1, vocab]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def _check(entries, reference: torch.Tensor, prompt: list[int]) -> None:
    assert len(entries) == len(prompt) - 1
    for i, entry in enumerate(entries):
        row = reference[i]
        assert entry.token_id == prompt[i + 1]
        assert entry.logprob == pytest.approx(row[prompt[i + 1]].item(), abs=1e-4)
        assert entry.rank == int((row > row[prompt[i + 1]]).sum()) + 1
        top_values, top_ids = row.topk(NUM_TOP)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(tiny_llama_dir, hf_model, max_num_batched_tokens):
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    prompts = _prompts(llm.engine.vocab_size)
    asked = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=NUM_TOP)
    # The same prompts without prompt logprobs first: their blocks are then in the prefix
    # cache, and batched with ones that ask.
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    first = llm.generate(prompts, plain)
    outputs = llm.generate(prompts + prompts, [asked] * len(prompts) + [plain] * len(prompts))
    repeats = outputs[len(prompts) :]
    asking = outputs[: len(prompts)]
    for prompt, output, again, before in zip(prompts, asking, repeats, first, strict=True):
        assert output.num_cached_tokens == 0  # no prefix hit: every prompt row computed
        _check(output.prompt_logprobs, _reference(hf_model, prompt), prompt)
        assert output.token_ids == again.token_ids == before.token_ids
        assert again.prompt_logprobs is None
