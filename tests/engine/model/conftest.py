"""The compiled CPU kernels, once per instruction-set level this host can run.

Every level up to the host's is built and tested (``PORTABLE`` and ``AVX2`` on any x86-64
host), so the lower levels' code paths are covered whatever CPU runs the tests.
"""

from __future__ import annotations

import shutil
from types import ModuleType

import pytest

from engine.cpu_isa import CpuIsa, host_isa
from engine.model.cpu_kernels import load_cpu_kernels

HOST_LEVELS = [level for level in CpuIsa if level <= host_isa()]


@pytest.fixture(scope="session", params=HOST_LEVELS, ids=lambda level: level.value)
def isa_level(request: pytest.FixtureRequest) -> CpuIsa:
    return request.param


@pytest.fixture(scope="session")
def kernels(isa_level: CpuIsa) -> ModuleType:
    """The kernels' module built for ``isa_level`` (a missing build fails: with a compiler
    present, an engine silently falling back to the torch paths would go unnoticed)."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    module = load_cpu_kernels(isa_level)
    assert module is not None, f"the CPU kernels do not build for {isa_level.value}"
    return module
