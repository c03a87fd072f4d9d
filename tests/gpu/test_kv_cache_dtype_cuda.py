"""An 8-bit KV cache (``--kv-cache-dtype int8|fp8_e4m3``) on a CUDA device, where the torch
paths quantize on write and dequantize on read: rows quantized on the device are the CPU
reference's (scales within their last bit, each code within one step), and greedy output over
an 8-bit cache on the device equals the CPU torch path's over the same cache dtype, batched and
after prefix-cache hits. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.kv_quant import KVQuant, dequantize_rows, quantize_rows
from tests.engine.test_generate_vs_hf import make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("quant", list(KVQuant))
def test_rows_quantized_on_the_device_are_the_cpu_references(quant):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 4, 64, generator=gen)
    x[:, :, 5] *= 20  # an outlier channel sets each row's scale
    x[7] = 0  # all-zero rows keep scale 1
    want = quantize_rows(x, quant)
    got = quantize_rows(x.cuda(), quant).cpu()
    # torch on CUDA divides by a Python number as a multiply by its reciprocal, so a scale
    # (absmax / max_code) can differ in its last bit, and a code whose x / scale sits on a
    # rounding boundary can land one step away.
    got_scale, want_scale = (r[..., 64:].contiguous().view(torch.float32) for r in (got, want))
    assert torch.allclose(got_scale, want_scale, rtol=2**-22, atol=0)
    got_x, want_x = (dequantize_rows(r, quant, torch.float32) for r in (got, want))
    step = want_scale if quant is KVQuant.INT8 else (want_x.abs() / 8).clamp_min(want_scale / 512)
    assert ((got_x - want_x).abs() <= step * 1.001).all()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_greedy_over_an_8bit_cache_on_the_device_equals_the_cpu_torch_path(
    tiny_llama_dir, kv_cache_dtype
):
    outputs = {}
    for device, backend in (("cpu", "torch"), ("cuda", "auto")):
        llm = LLM(
            str(tiny_llama_dir),
            device=device,
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            num_kv_blocks=256,
            kernel_backend=backend,
        )
        assert llm.engine.kv_cache.dtype == torch.uint8
        assert llm.engine.kv_cache.device.type == device
        prompts = make_prompts(llm.engine.vocab_size)
        batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        again = llm.generate(prompts[-2:], GREEDY)
        assert sum(o.num_cached_tokens for o in again) > 0
        assert [o.token_ids for o in again] == batched[-2:]
        outputs[device] = batched
    assert outputs["cuda"] == outputs["cpu"]
