"""The SDPA prefill path (``attention._sdpa``): lengths padded to a multiple of 16 on CPU give
the unpadded attention, against float64 softmax math."""

from __future__ import annotations

import pytest
import torch

from engine.model.attention import _sdpa, causal_mask


def reference(q, keys, values, mask):
    """Softmax attention in float64, GQA by repeating K/V, bottom-right causal by default."""
    q_len, ctx = q.shape[2], keys.shape[2]
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    scores = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    allowed = mask if mask is not None else causal_mask(q_len, ctx, None, q.device)
    if allowed is None:
        allowed = torch.ones(q_len, ctx, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "q_len,ctx,window",
    [
        (333, 333, None),
        (32, 32, None),
        (17, 17, None),
        (5, 40, None),
        (21, 333, None),
        (50, 50, 20),
    ],
)
def test_padded_sdpa_equals_attention_over_the_real_rows(dtype, atol, q_len, ctx, window):
    gen = torch.Generator().manual_seed(q_len + ctx)
    q = torch.randn(1, 9, q_len, 64, generator=gen).to(dtype)
    keys = torch.randn(1, 3, ctx, 64, generator=gen).to(dtype)
    values = torch.randn(1, 3, ctx, 64, generator=gen).to(dtype)
    mask = causal_mask(q_len, ctx, window, q.device)
    out = _sdpa(q, keys, values, mask)
    assert out.shape[2] == q_len + (-q_len % 16)
    want = reference(q, keys, values, mask)
    torch.testing.assert_close(out[:, :, :q_len].double(), want, atol=atol, rtol=0)
    assert torch.isfinite(out).all()
