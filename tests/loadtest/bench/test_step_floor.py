"""Step floors: the arithmetic of a step's read and compute floors and the table's sums; the
recorder notes every step's work as the engine did it (each computed token once, each sampled
token once) and comes off again; the measured weights are the model's linears, counted from its
checkpoint."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from engine.batch_runner import BatchRunner
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from loadtest.bench.step_floor import HostRates, StepWork, floor_table, measure_rates, worked_steps
from loadtest.bench.step_profile import Step

RATES = HostRates(
    weight_bytes=1_000_000,
    kv_bytes_per_token=100,
    decoder_flops_per_token=2_000,
    lm_head_flops_per_row=500,
    read_bytes_per_s=1e9,
    linear_flops_per_s=1e6,
)


def test_a_step_floor_is_its_larger_bound():
    decode = StepWork(Step.DECODE, num_tokens=4, num_sample_rows=4, context_tokens=10_000)
    assert RATES.read_floor_s(decode) == pytest.approx(2e-3)  # 1 MB weights + 1 MB KV at 1 GB/s
    assert RATES.compute_floor_s(decode) == pytest.approx(10e-3)  # 10,000 FLOPs at 1 MFLOP/s
    assert RATES.floor_s(decode) == pytest.approx(10e-3)
    small = StepWork(Step.DECODE, num_tokens=1, num_sample_rows=0, context_tokens=0)
    assert RATES.floor_s(small) == pytest.approx(2e-3)  # 1 MB at 1 GB/s beats 2 ms of FLOPs


def test_the_table_sums_each_kind_and_all():
    steps = [
        (StepWork(Step.MIXED, 100, 1, 0), 0.5),
        (StepWork(Step.DECODE, 1, 1, 0), 0.004),
        (StepWork(Step.DECODE, 1, 1, 0), 0.006),
    ]
    table = floor_table(steps, RATES)
    mixed_floor = (100 * 2_000 + 500) / 1e6
    decode_floor = 2 * (2_000 + 500) / 1e6
    assert f"| mixed | 1 | 0.500 | 0.001 | {mixed_floor:.3f} | {mixed_floor:.3f} |" in table
    assert (
        f"| decode | 2 | 0.010 | 0.002 | {decode_floor:.3f} | {decode_floor:.3f} | 2.00 |" in table
    )
    assert f"| all | 3 | 0.510 | 0.003 | {mixed_floor + decode_floor:.3f} |" in table


def test_every_step_is_noted_with_the_tokens_it_computed(tiny_llama_dir):
    originals = (LLMEngine.step, BatchRunner.run)
    llm = LLM(model=str(tiny_llama_dir), num_speculative_tokens=0, max_num_batched_tokens=32)
    prompts = [[5 + i, 17, 99, 3] * (5 + 3 * i) for i in range(3)]  # 20, 32 and 44 tokens
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with worked_steps() as steps:
        llm.generate(prompts, params)
    assert (LLMEngine.step, BatchRunner.run) == originals
    works = [work for work, _ in steps]
    # Every prompt token and every output token but the last is computed once; every output
    # token is sampled once.
    assert sum(w.num_tokens for w in works) == sum(map(len, prompts)) + 3 * (5 - 1)
    assert sum(w.num_sample_rows for w in works) == 3 * 5
    assert {w.kind for w in works} == {Step.MIXED, Step.DECODE}
    assert all(w.context_tokens > 0 for w in works if w.kind is Step.DECODE)
    assert all(wall_s > 0 for _, wall_s in steps)


def test_measured_weights_are_the_checkpoints_linears(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32")
    rates = measure_rates(llm.engine)
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    with safe_open(tiny_llama_dir / "model.safetensors", "pt") as checkpoint:
        shapes = {name: checkpoint.get_slice(name).get_shape() for name in checkpoint.keys()}  # noqa: SIM118
    decoder = sum(r * c for name, (r, c, *_) in _matrices(shapes) if "_proj." in name)
    head = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    lm_head = shapes[head][0] * shapes[head][1]
    assert rates.weight_bytes == 4 * (decoder + lm_head)
    assert rates.decoder_flops_per_token == 2 * decoder
    assert rates.lm_head_flops_per_row == 2 * lm_head
    assert rates.read_bytes_per_s > 0 and rates.linear_flops_per_s > 0
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
    assert rates.kv_bytes_per_token == 4 * kv_per_token  # float32 K and V of every layer


def _matrices(shapes: dict[str, list[int]]) -> list[tuple[str, list[int]]]:
    return [(name, shape) for name, shape in shapes.items() if len(shape) == 2]
