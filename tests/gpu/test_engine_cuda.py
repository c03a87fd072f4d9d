"""The engine on a CUDA device (the Triton attention kernels, decode steps replayed from CUDA
graphs; the compiled kernels are CPU-only):
greedy output equals Hugging Face transformers on the same device token for token in float32,
through batching, chunked prefill, preemption and prefix-cache hits; in bfloat16 every first
token that transformers picks by a clear margin is the engine's too; constrained and seeded
sampling work on device logits. Skipped without CUDA."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from engine.config import EngineConfig
from engine.constraint import Constraint, ConstraintKind
from engine.model.kernel_plan import KernelImpl
from loadtest.fixtures.tiny_model import ARCHITECTURES
from tests.engine.test_generate_vs_hf import hf_generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT_LENS = (1, 5, 16, 17, 31, 48, 64, 97)
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
# A first token counts in the bfloat16 check when transformers' top two log-probabilities
# differ by more than this: bfloat16's rounding moves logits by about 1e-2 here.
CLEAR_MARGIN = 0.25


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def hf_model(model_dir: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_case(request, tiny_model_dirs):
    model_dir = tiny_model_dirs[request.param]
    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=256)
    prompts = make_prompts(llm.engine.vocab_size)
    expected = hf_generate(hf_model(model_dir, torch.float32), prompts, MAX_TOKENS)
    return model_dir, llm, prompts, expected


def test_the_engine_runs_on_the_device(arch_case):
    _, llm, _, _ = arch_case
    assert llm.engine.device.type == "cuda"
    assert llm.engine.kv_cache.is_cuda
    kernels = llm.engine.kernels
    assert kernels.cpu_isa is None
    assert kernels.decode_attention is KernelImpl.TRITON
    assert kernels.prefill_attention is KernelImpl.TRITON
    assert kernels.decode_graphs > 0


def test_captured_steps_equal_eager_ones_in_bfloat16(tiny_model_dirs):
    """The graphs replay the eager step's kernels: the same tokens, also where bfloat16
    rounding decides them, batched and with drafts."""
    model_dir = str(tiny_model_dirs["llama"])
    common = {"device": "cuda", "dtype": "bfloat16", "num_kv_blocks": 256}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    graphed = LLM(model_dir, **common)
    eager = LLM(model_dir, enforce_eager=True, **common)
    prompts = make_prompts(graphed.engine.vocab_size, seed=3)
    assert eager.engine.runner.captured_decode is None
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    captured = graphed.engine.runner.captured_decode
    assert captured is not None and captured.graphs.num_replays > 0


def test_each_prompt_alone_matches_hf(arch_case):
    _, llm, prompts, expected = arch_case
    for prompt, want in zip(prompts, expected, strict=True):
        assert llm.generate([prompt], GREEDY)[0].token_ids == want


def test_all_prompts_batched_match_hf(arch_case):
    _, llm, prompts, expected = arch_case
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_chunked_prefill_and_prefix_hits_match_hf(arch_case):
    model_dir, _, prompts, expected = arch_case
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=24,
        check_kv_integrity=True,
    )
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0


def test_preemption_by_recompute_matches_hf(arch_case):
    model_dir, _, prompts, _ = arch_case
    long_prompts = [p for p in prompts if len(p) >= 16]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    reference = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=256)
    expected = [o.token_ids for o in reference.generate(long_prompts, params)]
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cuda",
            dtype="float32",
            num_kv_blocks=24,
            max_model_len=256,
            check_kv_integrity=True,
        )
    )
    for i, prompt in enumerate(long_prompts):
        engine.add_request(str(i), prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[int(out.req_id)] = out.token_ids
    assert engine.scheduler.num_preemptions > 0
    assert [finals[i] for i in range(len(long_prompts))] == expected


def test_bfloat16_first_tokens_agree_with_hf_where_clear(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    llm = LLM(str(model_dir), device="cuda", dtype="auto", num_kv_blocks=256)
    assert llm.engine.dtype == "bfloat16"
    prompts = make_prompts(llm.engine.vocab_size, seed=1)
    model = hf_model(model_dir, torch.bfloat16)
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    clear = 0
    for prompt, output in zip(prompts, got, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
        top2 = torch.log_softmax(logits, -1).topk(2)
        if (top2.values[0] - top2.values[1]).item() > CLEAR_MARGIN:
            clear += 1
            assert output.token_ids[0] == top2.indices[0].item()
    assert clear >= len(prompts) // 2


def test_constrained_and_seeded_sampling_on_device_logits(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), device="cuda", dtype="float32", num_kv_blocks=256)
    regex = Constraint(ConstraintKind.REGEX, r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)")
    choice = Constraint(ConstraintKind.CHOICE, choices=("alpha", "beta", "gamma delta"))
    prompts = make_prompts(llm.engine.vocab_size, seed=2)[:6]
    params = [
        SamplingParams(temperature=t, seed=s, max_tokens=64, constraint=c)
        for c in (regex, choice)
        for t, s in ((0.0, None), (1.0, 1), (1.0, 2))
    ]
    outputs = llm.generate(prompts, params)
    for p, output in zip(params, outputs, strict=True):
        assert output.finish_reason == "stop"
        if p.constraint is regex:
            assert re.fullmatch(regex.spec, output.text), output.text
        else:
            assert output.text in choice.choices
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=16)
    first = llm.generate(prompts, seeded)
    second = llm.generate(prompts, seeded)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


def compiled_variants(*, attention_only: bool) -> dict[str, int]:
    """How many variants of each of the engine's Triton kernels this process has compiled."""
    from engine.model.triton_kernels import decode, elementwise, kv_write, prefill

    kernels = {
        "decode": decode._decode_pieces,
        "merge": decode._merge_pieces,
        "prefill": prefill._prefill_kernel,
        "kv_write": kv_write._kv_write,
    }
    if not attention_only:
        kernels |= {
            "rms_norm": elementwise._rms_norm,
            "silu_and_mul": elementwise._silu_and_mul,
            "rotary": elementwise._rotary,
        }
    # JITFunction.device_caches: per device, the compiled kernels by specialization first.
    return {
        name: sum(len(caches[0]) for caches in fn.device_caches.values())
        for name, fn in kernels.items()
    }


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_serving_compiles_nothing_after_start_up(tiny_model_dirs, enforce_eager):
    """Every kernel variant a step needs is compiled while the engine starts: prompts of many
    lengths, chunked and batched with decodes, with contexts over several decode pieces,
    compile nothing more (a compilation takes seconds and stalls every request in the step).
    Under --enforce-eager no graph is captured, so the elementwise kernels compile at the
    first step: there only the attention kernels and the KV write are checked."""
    llm = LLM(
        str(tiny_model_dirs["llama"]),
        device="cuda",
        dtype="bfloat16",
        num_kv_blocks=256,
        max_num_batched_tokens=200,
        enforce_eager=enforce_eager,
    )
    before = compiled_variants(attention_only=enforce_eager)
    rng = random.Random(7)
    vocab_size = llm.engine.vocab_size
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (3, 40, 130, 300, 900)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 16 for o in outputs)
    assert compiled_variants(attention_only=enforce_eager) == before
