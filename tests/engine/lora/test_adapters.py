"""Loading and unloading adapters: what is refused, and that a reload never reuses old KV."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_hash import block_extra_key
from engine.lora.layers import LoraLinear, LoraStack, StepSelection
from engine.lora.names import parse_lora_modules
from engine.request_limits import check_client_cache_salt
from loadtest.fixtures.tiny_lora import make_tiny_lora

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_tiny_lora(tiny_llama_dir, root / "a", rank=4, seed=1),
        "b": make_tiny_lora(tiny_llama_dir, root / "b", rank=4, seed=2),
        "wide": make_tiny_lora(tiny_llama_dir, root / "wide", rank=32, seed=3),
        "head": make_tiny_lora(tiny_llama_dir, root / "head", rank=4, targets=["lm_head"]),
    }


@pytest.fixture(params=["native", "mock"])
def llm(request, tiny_llama_dir):
    return LLM(
        str(tiny_llama_dir), engine=request.param, dtype="float32", num_kv_blocks=64,
        enable_lora=True, max_loras=2, max_lora_rank=16,
    )  # fmt: skip


def test_what_cannot_be_loaded_is_refused_by_name(llm, adapters, tmp_path):
    engine = llm.engine
    with pytest.raises(ValueError, match="rank 32 is over --max-lora-rank 16"):
        engine.load_lora_adapter("wide", str(adapters["wide"]))
    with pytest.raises(ValueError, match="targets lm_head; only"):
        engine.load_lora_adapter("head", str(adapters["head"]))
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        engine.load_lora_adapter("none", str(tmp_path))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapters["a"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA adapters are not served"):
        engine.load_lora_adapter("dora", str(dora))
    with pytest.raises(ValueError, match="name"):
        engine.load_lora_adapter("has space", str(adapters["a"]))
    engine.load_lora_adapter("a", str(adapters["a"]))
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora_adapter("a", str(adapters["b"]))
    engine.load_lora_adapter("b", str(adapters["b"]))
    with pytest.raises(ValueError, match="--max-loras 2 adapters are loaded"):
        engine.load_lora_adapter("c", str(adapters["a"]))
    assert list(engine.lora_adapters) == ["a", "b"]
    with pytest.raises(ValueError, match="no LoRA adapter 'c' is loaded"):
        llm.generate([PROMPT], GREEDY, lora_name="c")
    # Nothing failed to load left a trace: the two loaded adapters still run.
    assert len(llm.generate([PROMPT, PROMPT], GREEDY, lora_name=["a", "b"])) == 2


def test_an_adapter_in_use_cannot_be_unloaded(llm, adapters):
    engine = llm.engine
    engine.load_lora_adapter("a", str(adapters["a"]))
    engine.add_request("r", PROMPT, GREEDY, lora_name="a")
    with pytest.raises(ValueError, match="in use by 1 requests"):
        engine.unload_lora_adapter("a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.unload_lora_adapter("a")
    assert engine.lora_adapters == {}
    with pytest.raises(ValueError, match="no LoRA adapter 'a' is loaded"):
        engine.unload_lora_adapter("a")


def test_a_reloaded_adapter_with_other_weights_never_hits_the_old_blocks(llm, adapters):
    engine = llm.engine
    engine.load_lora_adapter("x", str(adapters["a"]))
    assert llm.generate([PROMPT], GREEDY, lora_name="x")[0].num_cached_tokens == 0
    assert llm.generate([PROMPT], GREEDY, lora_name="x")[0].num_cached_tokens > 0
    engine.unload_lora_adapter("x")
    engine.load_lora_adapter("x", str(adapters["b"]))
    assert llm.generate([PROMPT], GREEDY, lora_name="x")[0].num_cached_tokens == 0


def test_lora_off_refuses_adapters(tiny_llama_dir, adapters):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="need --enable-lora"):
        llm.engine.load_lora_adapter("a", str(adapters["a"]))


def test_block_keys_of_adapters_and_salts_never_meet():
    assert block_extra_key("salt") == "salt"
    keyed = block_extra_key("salt", "a@1")
    assert keyed != block_extra_key("salt", "b@1") and keyed.startswith("\0")
    with pytest.raises(ValueError, match="NUL"):
        check_client_cache_salt(keyed)


@pytest.mark.parametrize(
    ("spec", "message"),
    [("a", "not name=path"), ("a=/x,a=/y", "given twice"), ("=/x", "not name=path")],
)
def test_lora_modules_flag_errors_name_the_flag(spec, message):
    with pytest.raises(ValueError, match=f"--lora-modules: .*{message}"):
        parse_lora_modules(spec)
    assert parse_lora_modules("a=/x, b=/y") == [("a", "/x"), ("b", "/y")]


@pytest.mark.parametrize(
    "token_slots",
    [[0, 0, 1, 1], [1, 0, 1, 0], [-1, 0, -1, 0], [0, 1, 0, 1, -1], [1, 1, 0, 0], [-1, -1]],
)
def test_a_steps_rows_get_their_own_adapters_term(token_slots):
    """The segmented matmul equals each row's own ``x @ A.T @ B.T`` (its slot's), whatever the
    order of the slots in the step (runs, interleaved, sorted backwards, none)."""
    torch.manual_seed(0)
    selection = StepSelection()
    base = torch.nn.Linear(6, 5, bias=False)
    lora = LoraLinear(base, (2, 3), 6, 2, 4, selection, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        lora.lora_a.normal_()
        lora.lora_b.normal_()
    stack = LoraStack([{"only": lora}], selection, max_loras=2, max_rank=4)
    x = torch.randn(len(token_slots), 6)
    stack.select(token_slots, torch.device("cpu"))
    with torch.no_grad():
        got = lora(x)
        expected = base(x)
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                expected[row] += x[row] @ lora.lora_a[slot].T @ lora.lora_b[slot].T
    torch.testing.assert_close(got, expected)
