"""A Hugging Face hub cache written on disk the way ``huggingface_hub`` writes it, offline.

``models--{org}--{name}/blobs/<hash>`` holds each file once (LFS files named by their sha256,
the others by their git blob sha1), ``snapshots/<commit>/<file>`` links to the blob
(``../../blobs/<hash>``), and ``refs/<branch or tag>`` holds a commit hash (no newline).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

# What the Hub stores in Git LFS, among the files a model repo has.
_LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


def commit_hash(label: str) -> str:
    """A 40-hex commit hash, stable for `label`."""
    return hashlib.sha1(label.encode()).hexdigest()


def repo_dir(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def _blob_name(path: Path, data: bytes) -> str:
    if path.suffix in _LFS_SUFFIXES:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(
    cache: Path,
    repo_id: str,
    source_dir: Path,
    commit: str,
    refs: Iterable[str] = ("main",),
    files: Iterable[str] | None = None,
) -> Path:
    """Put `files` of `source_dir` (default: all of its files) in the cache as the snapshot
    `commit` of `repo_id`, pointed at by each ref in `refs`; return the snapshot directory."""
    storage = repo_dir(cache, repo_id)
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (storage / "blobs").mkdir(exist_ok=True)
    names = sorted(p.name for p in source_dir.iterdir() if p.is_file()) if files is None else files
    for name in names:
        data = (source_dir / name).read_bytes()
        blob = storage / "blobs" / _blob_name(source_dir / name, data)
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / name
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return snapshot
