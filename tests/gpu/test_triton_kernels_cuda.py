"""The Triton kernels compiled for the GPU: the checks the CPU runs under the interpreter
(tests/engine/model/test_triton_kernels.py, test_triton_prefill.py), on CUDA tensors. Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

triton = pytest.importorskip("triton")

from tests.engine.model.test_triton_kernels import (  # noqa: E402
    QUANTS,
    _decode_codes,
    _encode_values,
    check_decode,
    check_kv_write,
)
from tests.engine.model.test_triton_ops import (  # noqa: E402
    check_add_rms_norm,
    check_rms_norm,
    check_rotary,
    check_silu_and_mul,
)
from tests.engine.model.test_triton_prefill import CASES, check_prefill  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.value if q else "unquantized")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 20])
def test_decode_on_the_device(quant, dtype, window):
    check_decode("cuda", dtype, quant, window)


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.value if q else "unquantized")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_write_on_the_device(quant, dtype):
    check_kv_write("cuda", dtype, quant)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_prefill_on_the_device(case):
    check_prefill("cuda", case)


def test_fp8_codes_on_the_device_are_torchs():
    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    values = codes.view(torch.float8_e4m3fn).float()
    finite = values.isfinite()
    assert torch.equal(_decode_codes(codes)[finite], values[finite])
    samples = torch.linspace(-448, 448, 4097, device="cuda")
    assert torch.equal(_encode_values(samples), samples.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_elementwise_ops_on_the_device(dtype):
    for num_tokens in (1, 300):
        check_rms_norm("cuda", dtype, num_tokens)
        check_silu_and_mul("cuda", dtype, num_tokens)
    check_add_rms_norm("cuda", dtype)
    check_rotary("cuda", dtype)
