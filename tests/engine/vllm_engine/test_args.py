"""``--engine vllm``'s flags: splitserve's shared ones become vLLM engine arguments and
``--vllm-args`` come last, so vLLM's own parser lets them win."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.vllm_engine.args import vllm_argv


def _value(argv: list[str], flag: str) -> str:
    """The last value given to ``flag`` (as an argparse parser reads it)."""
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


def test_shared_flags_map_and_vllm_args_come_last(tiny_llama_dir):
    config = EngineConfig(
        model=str(tiny_llama_dir),
        engine="vllm",
        dtype="float32",
        max_model_len=512,
        max_num_seqs=7,
        kv_cache_memory_gb=0.5,
        enforce_eager=True,
        served_model_name="tiny",
        vllm_args='--max-num-seqs 9 --speculative-config \'{"method": "ngram"}\'',
    )
    argv = vllm_argv(config, cuda=False)
    assert _value(argv, "--model") == str(tiny_llama_dir)
    assert _value(argv, "--served-model-name") == "tiny"
    assert _value(argv, "--dtype") == "float32"
    assert _value(argv, "--max-model-len") == "512"
    assert _value(argv, "--kv-cache-memory-bytes") == str(1 << 29)
    assert "--enforce-eager" in argv and "--enable-prefix-caching" in argv
    # --vllm-args is split as a shell would and overrides what came before.
    assert _value(argv, "--max-num-seqs") == "9"
    assert argv[-2:] == ["--speculative-config", '{"method": "ngram"}']


def test_cpu_defaults_are_the_native_engines(tiny_llama_dir):
    from engine.cpu_isa import cpu_auto_dtype, resolve_isa

    argv = vllm_argv(EngineConfig(model=str(tiny_llama_dir), engine="vllm"), cuda=False)
    assert _value(argv, "--dtype") == cpu_auto_dtype(resolve_isa("auto"))
    # Served (and labelled in vLLM's metrics) under --model as given, as the native engine is.
    assert _value(argv, "--served-model-name") == str(tiny_llama_dir)
    assert (
        _value(vllm_argv(EngineConfig(model=str(tiny_llama_dir)), cuda=True), "--dtype") == "auto"
    )


def test_a_kv_cache_dtype_vllm_lacks_is_refused_by_name(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="--kv-cache-dtype int8: vLLM has no such KV cache"):
        vllm_argv(config, cuda=False)


def test_vllms_own_parser_reads_the_arguments(tiny_llama_dir):
    pytest.importorskip("vllm")
    from engine.vllm_engine.args import engine_args

    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", vllm_args="--tensor-parallel-size 2"
    )
    args = engine_args(config, cuda=False)
    assert args.tensor_parallel_size == 2 and args.dtype == "float32"
    assert args.kv_events_config is not None
    with pytest.raises(SystemExit):
        engine_args(EngineConfig(model=str(tiny_llama_dir), vllm_args="--no-such-flag"), cuda=False)
