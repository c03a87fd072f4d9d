"""Prompt-lookup speculation end to end: a greedy request's output is the same with drafts as
without them, token for token, on every attention path; stop strings and stop ids still cut
where they would."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.ngram_proposer import NgramProposer
from engine.request import Request
from tests.engine.test_engine import random_prompt


def prompts() -> list[list[int]]:
    return [random_prompt(9 + 5 * i, seed=i) for i in range(6)]


class OracleProposer(NgramProposer):
    """Drafts a reference output's next tokens, every ``wrong_every``-th one changed.

    A random tiny model does not repeat itself, so prompt lookup would find few drafts it
    accepts; drafting the known answer exercises acceptance, partial acceptance and rejection
    at every position instead.
    """

    def __init__(self, reference: dict[tuple[int, ...], list[int]], wrong_every: int) -> None:
        super().__init__(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=1)
        self.reference = reference
        self.wrong_every = wrong_every
        self.num_proposals = 0

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        ahead = self.reference[tuple(request.prompt_token_ids)][request.num_output_tokens :]
        draft = ahead[: min(max_tokens, self.num_speculative_tokens)]
        self.num_proposals += 1
        if draft and self.num_proposals % self.wrong_every == 0:
            draft[self.num_proposals % len(draft)] += 1
        return draft


def generate(llm: LLM, params: SamplingParams) -> dict[tuple[int, ...], list[int]]:
    outputs = llm.generate(prompts(), params)
    return {tuple(p): out.token_ids for p, out in zip(prompts(), outputs, strict=True)}


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"dtype": "float32"}, id="float32-cpp"),
        pytest.param({"dtype": "float32", "kernel_backend": "torch"}, id="float32-torch"),
        pytest.param({"dtype": "bfloat16", "kv_cache_dtype": "int8"}, id="bf16-int8-cpp"),
        pytest.param({"dtype": "float32", "kv_cache_dtype": "fp8_e4m3"}, id="float32-fp8-cpp"),
        # The lower levels' kernels: AVX2 float32 (runs share a task), 8-bit and portable loops.
        pytest.param({"dtype": "float32", "cpu_isa": "avx2"}, id="float32-avx2"),
        pytest.param(
            {"dtype": "float32", "kv_cache_dtype": "int8", "cpu_isa": "avx2"}, id="int8-avx2"
        ),
        pytest.param({"dtype": "float32", "cpu_isa": "portable"}, id="float32-portable"),
    ],
)
def test_greedy_output_is_the_same_with_and_without_drafts(tiny_llama_dir, engine_kwargs):
    check_drafts_keep_greedy_output(tiny_llama_dir, **engine_kwargs)


def check_drafts_keep_greedy_output(model_dir: Path, **engine_kwargs: object) -> None:
    """The same greedy outputs without drafts, with the real prompt lookup and with a drafter
    that knows the answer but gets one draft in 3 wrong (also run on CUDA: tests/gpu)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    common = {"num_kv_blocks": 256, "check_kv_integrity": True, **engine_kwargs}
    plain = LLM(str(model_dir), num_speculative_tokens=0, **common)
    reference = generate(plain, params)
    assert plain.engine.scheduler.num_draft_tokens == 0
    spec = LLM(str(model_dir), num_speculative_tokens=4, **common)
    # The real prompt lookup: its drafts are mostly rejected here.
    assert generate(spec, params) == reference
    assert spec.engine.scheduler.num_draft_tokens > 0
    oracle = LLM(str(model_dir), num_speculative_tokens=4, **common)
    oracle.engine.scheduler.proposer = OracleProposer(reference, wrong_every=3)
    assert generate(oracle, params) == reference
    scheduler = oracle.engine.scheduler
    assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens


@pytest.fixture(scope="module")
def plain_llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, num_speculative_tokens=0)


@pytest.fixture(scope="module")
def spec_llm(tiny_llama_dir, plain_llm):
    """Drafts the plain engine's greedy outputs of ``prompts()`` (40 tokens), one in 4 wrong."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, num_speculative_tokens=4)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm.engine.scheduler.proposer = OracleProposer(generate(plain_llm, params), wrong_every=4)
    return llm


def test_a_stop_string_inside_accepted_drafts_cuts_the_tokens_too(spec_llm):
    prompt = prompts()[2]
    base = spec_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert spec_llm.engine.scheduler.num_accepted_tokens > 0
    tokenizer = spec_llm.tokenizer.backend
    # A stop string that ends inside the output: the output stops at the token completing it.
    for end in range(10, 25):
        text = tokenizer.decode(base.token_ids[:end])
        prefix = tokenizer.decode(base.token_ids[: end - 1])
        if len(text) > len(prefix) + 1 and text.startswith(prefix):
            stop = text[len(prefix) :]
            break
    else:
        pytest.skip("no token of this output adds a multi-character piece")
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=[stop])
    out = spec_llm.generate([prompt], params)[0]
    cut = base.text.index(stop)
    assert out.text == base.text[:cut] and out.finish_reason == "stop"
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    assert stop in tokenizer.decode(out.token_ids)
    assert stop not in tokenizer.decode(out.token_ids[:-1])


def test_stop_ids_and_max_tokens_cut_as_without_drafts(spec_llm, plain_llm):
    prompt = prompts()[4]
    plain = plain_llm
    base = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=25))[0]
    stop_id = base.token_ids[12]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=25, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=7),
        SamplingParams(temperature=0.0, max_tokens=25, logprobs=2),
    ):
        want = plain.generate([prompt], params)[0]
        got = spec_llm.generate([prompt], params)[0]
        assert (got.token_ids, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.finish_reason,
            want.stop_reason,
        )


def test_drafts_under_preemption_and_chunked_prefill_keep_outputs_and_blocks(tiny_llama_dir):
    check_drafts_under_preemption(tiny_llama_dir)


def check_drafts_under_preemption(model_dir: Path, **engine_kwargs: object) -> None:
    """A pool too small for the batch (preemptions, recomputation) and prompts cut into
    chunks, with drafts accepted and rejected: the outputs are the reference's and every
    block comes back (also run on CUDA: tests/gpu)."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    common = {
        "dtype": "float32",
        "max_num_batched_tokens": 24,
        "max_model_len": 128,
        "check_kv_integrity": True,
        **engine_kwargs,
    }
    plain = LLM(str(model_dir), num_speculative_tokens=0, num_kv_blocks=256, **common)
    reference = generate(plain, params)
    tight = LLM(str(model_dir), num_speculative_tokens=4, num_kv_blocks=10, **common)
    proposer = OracleProposer(reference, wrong_every=2)
    tight.engine.scheduler.proposer = proposer
    assert generate(tight, params) == reference
    scheduler = tight.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.num_accepted_tokens > 0
    pool = tight.engine.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
