"""Triton kernels over the paged KV cache: the engine's attention on GPUs.

``decode`` (flash-decoding over the paged cache), ``prefill`` (variable-length chunks over a
cached context, one launch) and ``kv_write`` (new tokens' K/V into their slots, quantizing for
8-bit caches) read and write the cache in place, in its layout (``PagedKVCache``): a row is
``head_dim`` values, or ``head_dim`` one-byte codes followed by their float32 scale. The same
kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the
tests check them against the torch reference paths on machines without a GPU.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (it ships with torch's CUDA builds)."""
    return importlib.util.find_spec("triton") is not None
