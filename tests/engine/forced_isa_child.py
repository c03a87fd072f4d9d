"""Child process of ``test_forced_cpu_isa``: greedy token ids at a forced CPU level.

``python -m tests.engine.forced_isa_child MODEL_DIR LEVEL ADAPTER_DIR`` prints one JSON object:
the token ids of ``make_prompts`` in float32 and bfloat16 (chunked prefill, mixed steps;
bfloat16's ``auto`` cache is int8), in float32 over an int8 cache by the compiled and the torch
paths, in float32 with the LoRA adapter at ``ADAPTER_DIR`` (every prompt twice in one batch,
with the adapter and without), each engine's kernel plan, and the level torch's own kernels run
at. Run with
``library_env(LEVEL)`` set, as an operator reproducing a smaller host would.
"""

from __future__ import annotations

import json
import sys

import torch

from engine import LLM, SamplingParams
from tests.engine.test_generate_vs_hf import MAX_TOKENS, make_prompts


def main(model_dir: str, level: str, adapter_dir: str) -> None:
    result: dict[str, object] = {"aten_capability": torch.backends.cpu.get_cpu_capability()}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(
            model_dir, dtype=dtype, cpu_isa=level, num_kv_blocks=256, max_num_batched_tokens=24
        )
        prompts = make_prompts(llm.engine.vocab_size)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        result[dtype] = [out.token_ids for out in outs]
        result[f"{dtype}_kernels"] = llm.engine.runner.kernels.describe()
    for backend in ("cpp", "torch"):
        llm = LLM(
            model_dir,
            dtype="float32",
            kv_cache_dtype="int8",
            kernel_backend=backend,
            cpu_isa=level,
            num_kv_blocks=256,
            max_num_batched_tokens=24,
        )
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        result[f"int8_{backend}"] = [out.token_ids for out in outs]
    llm = LLM(
        model_dir,
        dtype="float32",
        cpu_isa=level,
        num_kv_blocks=256,
        max_num_batched_tokens=24,
        enable_lora=True,
        lora_modules=f"adapter={adapter_dir}",
    )
    outs = llm.generate(
        prompts * 2,
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        lora_name=["adapter"] * len(prompts) + [""] * len(prompts),
    )
    result["lora"] = [out.token_ids for out in outs]
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
