"""What the host CPU can do, detected once: the instruction-set level every kernel choice asks.

Levels, each including the ones below it (x86-64; any other CPU is ``PORTABLE``)::

    PORTABLE < AVX2 (+FMA, F16C) < AVX512 (F, BW, VL, DQ) < AVX512_BF16 (+VNNI) < AMX (tiles)

What depends on the level:

- the compiled CPU kernels (``model/cpu_kernels.py``) are built for the level, not for
  ``-march=native``, so a lower level forced on a better host runs the lower level's code;
- oneDNN-packed bfloat16 linears need AVX512 (oneDNN's bf16 reorder refuses AVX2 hosts);
- the compiled paged prefill kernel, the pair-dot-product decode path and the integer key
  scores of int8 caches (VNNI, which every AVX-512 BF16 CPU has) need AVX512_BF16;
- ``--dtype auto`` is bfloat16 from AVX512_BF16 up (native bf16 dot products), float32 below
  (bf16 is emulated there: see BENCHMARKS.md).

An operator forces a lower level with ``--cpu-isa`` / ``SPLITSERVE_CPU_ISA`` to reproduce a
smaller host. torch's own kernels and oneDNN pick theirs from the real CPU unless their own
variables lower them too (``library_env``); ``splitserve up`` sets those for the processes it
starts. A level above the host's is refused: it would run instructions the CPU lacks.
"""

from __future__ import annotations

import enum
import functools
import logging
import platform
from pathlib import Path

logger = logging.getLogger(__name__)

# The ``--cpu-isa`` flag's choices: "auto" (the host's level) or a level's value.
AUTO = "auto"


@functools.total_ordering
class CpuIsa(enum.Enum):
    """An x86-64 instruction-set level, ordered (``CpuIsa.AVX2 < CpuIsa.AVX512``)."""

    PORTABLE = "portable"
    AVX2 = "avx2"
    AVX512 = "avx512"
    AVX512_BF16 = "avx512_bf16"
    AMX = "amx"

    def __lt__(self, other: CpuIsa) -> bool:
        return _ORDER.index(self) < _ORDER.index(other)

    @property
    def compiler_flags(self) -> tuple[str, ...]:
        """g++ flags that allow exactly this level's instructions (no ``-march=native``)."""
        return _COMPILER_FLAGS[self]

    @property
    def onednn_max_cpu_isa(self) -> str:
        """oneDNN's ``ONEDNN_MAX_CPU_ISA`` value for this level."""
        return _ONEDNN_ISA[self]

    @property
    def aten_cpu_capability(self) -> str:
        """torch's ``ATEN_CPU_CAPABILITY`` value for this level."""
        return "default" if self is CpuIsa.PORTABLE else "avx2" if self is CpuIsa.AVX2 else "avx512"


_ORDER = (CpuIsa.PORTABLE, CpuIsa.AVX2, CpuIsa.AVX512, CpuIsa.AVX512_BF16, CpuIsa.AMX)
ISA_CHOICES = (AUTO, *(level.value for level in _ORDER))

# /proc/cpuinfo flags each level needs on top of the one below it.
_REQUIRED_FLAGS = {
    CpuIsa.AVX2: {"avx2", "fma", "f16c"},
    CpuIsa.AVX512: {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    CpuIsa.AVX512_BF16: {"avx512_bf16", "avx512_vnni"},
    CpuIsa.AMX: {"amx_bf16", "amx_int8", "amx_tile"},
}
_X86_64_V4 = ("-march=x86-64-v4",)
_COMPILER_FLAGS = {
    CpuIsa.PORTABLE: ("-march=x86-64",),
    CpuIsa.AVX2: ("-march=x86-64-v3",),
    CpuIsa.AVX512: _X86_64_V4,
    CpuIsa.AVX512_BF16: (*_X86_64_V4, "-mavx512bf16", "-mavx512vnni"),
    CpuIsa.AMX: (
        *_X86_64_V4,
        "-mavx512bf16",
        "-mavx512vnni",
        "-mamx-tile",
        "-mamx-bf16",
        "-mamx-int8",
    ),
}
_ONEDNN_ISA = {
    CpuIsa.PORTABLE: "SSE41",
    CpuIsa.AVX2: "AVX2",
    CpuIsa.AVX512: "AVX512_CORE",
    CpuIsa.AVX512_BF16: "AVX512_CORE_BF16",
    CpuIsa.AMX: "AVX512_CORE_AMX",
}


def level_from_flags(cpu_flags: set[str]) -> CpuIsa:
    """The highest level whose flags (and every lower level's) are all in ``cpu_flags``."""
    level = CpuIsa.PORTABLE
    for candidate in _ORDER[1:]:
        if not _REQUIRED_FLAGS[candidate] <= cpu_flags:
            break
        level = candidate
    return level


def _cpuinfo_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


@functools.cache
def host_isa() -> CpuIsa:
    """The host CPU's level (read once from ``/proc/cpuinfo``; ``PORTABLE`` off x86-64)."""
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return CpuIsa.PORTABLE
    return level_from_flags(_cpuinfo_flags())


def resolve_isa(requested: str, host: CpuIsa | None = None) -> CpuIsa:
    """The level to run at for ``--cpu-isa requested`` (``auto``: the host's).

    Raises ``ValueError`` for an unknown name or a level above the host's.
    """
    host = host_isa() if host is None else host
    if requested == AUTO:
        return host
    try:
        level = CpuIsa(requested)
    except ValueError:
        raise ValueError(
            f"cpu_isa must be one of {', '.join(ISA_CHOICES)}, got {requested!r}"
        ) from None
    if level > host:
        raise ValueError(
            f"cpu_isa {level.value} is above this host's level ({host.value}): "
            "its instructions would not run here"
        )
    return level


def cpu_auto_dtype(level: CpuIsa) -> str:
    """``--dtype auto`` on a CPU of ``level``: bfloat16 with native bf16 dot products (from
    AVX512_BF16), float32 below, where bf16 matmuls are emulated (~4.6x slower than float32 on
    AVX2, see BENCHMARKS.md)."""
    return "bfloat16" if level >= CpuIsa.AVX512_BF16 else "float32"


def library_env(level: CpuIsa) -> dict[str, str]:
    """Env vars that cap torch's and oneDNN's own kernels at ``level`` in a new process (each
    library reads its variable once, at its first kernel call; at or above the host's level
    they change nothing)."""
    return {
        "ONEDNN_MAX_CPU_ISA": level.onednn_max_cpu_isa,
        "ATEN_CPU_CAPABILITY": level.aten_cpu_capability,
    }
