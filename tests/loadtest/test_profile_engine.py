"""The engine profiler: its timers see every step and every part, add up, and come off again."""

from __future__ import annotations

import torch

from engine.llm import LLM
from engine.model import attention
from engine.model.packed_linear import PackedLinear
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from loadtest import profile_engine
from loadtest.profile_engine import PARTS, Step, step_timers


def test_timers_split_steps_and_parts_and_restore_the_engine(tiny_llama_dir):
    originals = (ModelRunner.execute, PackedLinear.forward, attention._decode, attention._sdpa)
    llm = LLM(model=str(tiny_llama_dir), kv_cache_dtype="int8", max_num_batched_tokens=64)
    prompts = [[5 + i, 17, 99, 3] * 10 for i in range(3)]  # 40 tokens each: one chunk per step
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with step_timers() as timers:
        outputs = list(llm.generate_stream(prompts, params))
    assert (
        ModelRunner.execute,
        PackedLinear.forward,
        attention._decode,
        attention._sdpa,
    ) == originals
    finished = [o for o in outputs if o.finished]
    assert len(finished) == 3 and all(len(o.token_ids) == 4 for o in finished)
    assert timers.steps[Step.MIXED] >= 2 and timers.steps[Step.DECODE] >= 1
    for kind in Step:
        parts = sum(timers.seconds[(kind, part)] for part in PARTS)
        assert 0 < parts <= timers.seconds[(kind, "execute")]
    assert timers.seconds[(Step.DECODE, "decode attention")] > 0
    assert timers.seconds[(Step.MIXED, "K/V writes")] > 0
    assert timers.seconds[(Step.DECODE, "prefill SDPA")] == 0


def test_main_prints_one_row_per_kind_of_step(capsys, tiny_llama_dir):
    argv = ["--model", str(tiny_llama_dir), "--num-prompts", "3", "--min-prompt-tokens", "8"]
    argv += ["--max-prompt-tokens", "20", "--output-tokens", "3", "--threads", "1"]
    assert profile_engine.main(argv) == 0
    out = capsys.readouterr().out
    assert "| decode | 2 |" in out and "| mixed | 1 |" in out
    assert f"{torch.get_num_threads()} threads" in out
