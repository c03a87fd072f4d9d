from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run on CPU tensors under Triton's interpreter; it must be
# chosen before any kernel module is imported (``triton.jit`` reads it then).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loadtest.fixtures.tiny_model import ARCHITECTURES, make_tiny_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random model directory per architecture, built once per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]
