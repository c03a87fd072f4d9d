"""JIT-built C++ CPU kernels (``csrc/``), with the pure-torch path as reference and fallback.

The paged decode kernel reads K/V tiles in place through the block tables, where the torch
path must first gather them into a padded copy; on a 2-core host that halves a decode step's
attention time. It is compiled once per machine with the host's instruction set (the build is
cached by torch under ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and
checked against the torch path in ``tests/engine/model/test_cpu_kernels.py``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# (head_dim, block_size) pairs the kernel is instantiated for (see SPLITSERVE_DECODE_CASE).
PAGED_DECODE_SHAPES = frozenset({(16, 16), (32, 16), (64, 16), (128, 16)})
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]


def _cpu_signature() -> str:
    """Host ISA fingerprint: a ``-march=native`` build must not be reused on another CPU."""
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = "unknown"
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


@functools.cache
def load_paged_decode() -> ModuleType | None:
    """The compiled kernel module, or None (logged) when it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        start_s = time.perf_counter()
        module = load(
            name=f"splitserve_paged_decode_{_cpu_signature()}",
            sources=[str(_SOURCE)],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # a missing compiler or ninja must not stop the engine
        logger.warning("CPU paged-decode kernel unavailable, using the torch path: %s", exc)
        return None
    logger.info("CPU paged-decode kernel ready in %.1f s", time.perf_counter() - start_s)
    return module
