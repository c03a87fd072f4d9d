"""JIT-built C++ CPU kernels (``csrc/``), with the torch paths as reference and fallback.

- ``paged_decode`` reads K/V tiles in place through the block tables, where the torch path
  must first gather them into a padded copy. Any dtype; bfloat16 on AVX-512 BF16 hosts uses
  pair dot products and a vectorized softmax.
- ``paged_decode_quantized``: the same over an 8-bit cache (int8 or fp8 e4m3 codes with a
  float32 scale per row, ``kv_quant``), codes widened per tile, scales folded into the scores
  and the softmax weights; ``kv_write_quantized`` and ``dequantize_kv_blocks`` write and
  widen 8-bit rows in one pass each.
- ``paged_prefill`` (bfloat16 from AVX512_BF16, float32 from AVX2; head_dim 32, 64 or 128)
  runs every prefill chunk of a step in one call, reading each chunk's context in place: about
  4x the throughput of SDPA's CPU flash kernel in bfloat16 on SmolLM2's shapes
  (``paged_prefill_supported(dtype, ...)`` says where).
- ``rms_norm`` (with the residual add fused), ``rotary_`` and ``silu_and_mul`` (float32 and
  bfloat16): one pass each instead of several torch ops; used through ``ops.FusedCpuOps``.

The module is compiled once per machine and instruction-set level (``engine.cpu_isa``): the
level's ``-march`` flags, never ``-march=native``, so a level forced below the host's runs that
level's code paths (the AVX-512 BF16 paths exist only in builds for AVX512_BF16 and up; below,
the portable loops, auto-vectorized for AVX2 at that level). The build is cached by torch under
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``); each level is checked against
the torch paths in ``tests/engine/model/test_cpu_kernels.py`` and ``test_ops.py``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path
from types import ModuleType

from engine.cpu_isa import CpuIsa

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).parent / "csrc"
SOURCES = (
    "paged_decode.cpp",
    "paged_decode_avx2.cpp",
    "paged_decode_quantized.cpp",
    "kv_quant.cpp",
    "read_floor.cpp",
    "paged_prefill.cpp",
    "paged_prefill_avx2.cpp",
    "fused_ops.cpp",
    "bindings.cpp",
)
# (head_dim, block_size) pairs paged_decode is instantiated for (see decode_task in csrc/).
PAGED_DECODE_SHAPES = frozenset({(16, 16), (32, 16), (64, 16), (128, 16)})
# -mtune only schedules instructions for this CPU; the level's -march decides which exist.
_CFLAGS = ["-O3", "-mtune=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]


def _build_signature() -> str:
    """Host CPU and kernel sources: a ``-mtune=native`` build is tuned for one CPU, and torch's
    build cache does not notice a changed header."""
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = "unknown"
    digest = hashlib.sha256(flags.encode())
    for path in sorted(CSRC_DIR.iterdir()):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


@functools.cache
def load_cpu_kernels(level: CpuIsa) -> ModuleType | None:
    """The kernels' module built for ``level`` (at most the host's: see ``cpu_isa``), or None
    (logged) when it cannot be built here. One build and one module per level and process."""
    try:
        from torch.utils.cpp_extension import load

        start_s = time.perf_counter()
        module = load(
            name=f"splitserve_cpu_kernels_{level.value}_{_build_signature()}",
            sources=[str(CSRC_DIR / name) for name in SOURCES],
            extra_cflags=[*level.compiler_flags, *_CFLAGS],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # a missing compiler or ninja must not stop the engine
        logger.warning("CPU kernels unavailable, using the torch paths: %s", exc)
        return None
    logger.info("CPU kernels for %s ready in %.1f s", level.value, time.perf_counter() - start_s)
    return module
