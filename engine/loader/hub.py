"""Fetch a Hugging Face Hub model repo (``org/name``) into the Hugging Face cache, cache first.

Only the files the engine reads are fetched: ``config.json``, ``generation_config.json``, the
tokenizer files and the safetensors weights (``model.safetensors``, or
``model.safetensors.index.json`` and the shards it lists). ``huggingface_hub`` places them in its
usual cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``) and reads
``HF_TOKEN`` (gated and private repos), ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` itself.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

from huggingface_hub import constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

logger = logging.getLogger(__name__)

# The shape of a Hub repo id; huggingface_hub validates the finer rules ("--", "..", length).
# Each part starts and ends with a word character, so "./x" or "x/" stay (missing) paths.
_REPO_ID_RE = re.compile(r"\w(?:[\w.-]*\w)?/\w(?:[\w.-]*\w)?")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
)
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
_MODEL_FILES = ("config.json", *TOKENIZER_FILES, WEIGHTS_FILE, WEIGHTS_INDEX_FILE)


class ModelFetchError(ValueError):
    """A Hub repo that is neither complete in the cache nor downloadable. One-line message."""


def is_repo_id(name: str) -> bool:
    """Whether `name` has the shape of a Hub repo id, ``org/name``."""
    return _REPO_ID_RE.fullmatch(name) is not None


def fetch_repo(repo_id: str, revision: str | None = None, *, tokenizer_only: bool = False) -> Path:
    """Return the cached snapshot directory of `repo_id` at `revision` (default: main) holding
    the files the engine needs (with `tokenizer_only`: only the tokenizer's, as the router).

    Cache first: a cached snapshot with every needed file is returned without any network
    access (a cached branch is therefore not checked for newer commits; pass a commit hash to
    pin one). Otherwise the missing files are downloaded into the cache, unless
    ``HF_HUB_OFFLINE`` is set. Raises `ModelFetchError` (one line) when the repo or revision
    does not exist, is gated, has no safetensors weights, or the Hub is unreachable while the
    snapshot is not cached.
    """
    label = repo_id if revision is None else f"{repo_id} (revision {revision})"
    patterns = list(TOKENIZER_FILES if tokenizer_only else _MODEL_FILES)
    try:
        cached = _cached_snapshot(repo_id, revision, patterns)
        if cached is not None and not _missing_files(cached, tokenizer_only):
            logger.debug("using cached snapshot %s", cached)
            return cached
        if constants.HF_HUB_OFFLINE:
            raise ModelFetchError(
                f"Hugging Face model {label} is not in the cache {constants.HF_HUB_CACHE} "
                "(or only in part) and HF_HUB_OFFLINE is set"
            )
        start_s = time.perf_counter()
        # With the Hub unreachable this returns the partial cached snapshot, if any; the loop
        # below then raises why.
        snapshot = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
        # The snapshot directory is named by its commit: whatever comes next comes from it,
        # even if the branch moves meanwhile.
        commit = snapshot.name
        if not tokenizer_only and (snapshot / WEIGHTS_INDEX_FILE).is_file():
            shards = _missing_files(snapshot, tokenizer_only=False)
            if shards:  # the ones the index names, fetched in parallel
                snapshot_download(repo_id, revision=commit, allow_patterns=shards)
        for name in _missing_files(snapshot, tokenizer_only):
            # Raises why the file is missing: an unreachable Hub or a repo without it.
            _fetch_file(repo_id, commit, name, label)
    except (HfHubHTTPError, LocalEntryNotFoundError, HFValidationError) as exc:
        raise ModelFetchError(f"cannot fetch Hugging Face model {label}: {_reason(exc)}") from exc
    logger.info("fetched %s into %s in %.1f s", label, snapshot, time.perf_counter() - start_s)
    return snapshot


def _fetch_file(repo_id: str, commit: str, name: str, label: str) -> None:
    try:
        hf_hub_download(repo_id, name, revision=commit)
    except RemoteEntryNotFoundError as exc:
        raise ModelFetchError(
            f"Hugging Face model {label} has no {name}: only safetensors checkpoints load "
            "(for a GGUF repo, download its .gguf file and pass that path)"
        ) from exc


def _cached_snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path | None:
    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=patterns, local_files_only=True
            )
        )
    except LocalEntryNotFoundError:  # also an incomplete snapshot huggingface_hub knows of
        return None


def _missing_files(snapshot: Path, tokenizer_only: bool) -> list[str]:
    """The needed files `snapshot` lacks, weight shards included (per the index)."""
    needed = ["tokenizer.json"]
    if not tokenizer_only:
        needed.append("config.json")
        index = snapshot / WEIGHTS_INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            needed += sorted(set(weight_map.values()))
        else:
            needed.append(WEIGHTS_FILE)
    return [name for name in needed if not (snapshot / name).is_file()]


def _reason(exc: Exception) -> str:
    """What went wrong, on one line (huggingface_hub's messages span several)."""
    if isinstance(exc, GatedRepoError):
        return "the repo is gated: accept its terms on the Hub and set HF_TOKEN"
    if isinstance(exc, RepositoryNotFoundError):
        return "no such repo (or it is private: set HF_TOKEN)"
    if isinstance(exc, RevisionNotFoundError):
        return "no such revision in the repo"
    if isinstance(exc, LocalEntryNotFoundError):
        cause = exc.__cause__
        detail = f" ({type(cause).__name__}: {_first_line(cause)})" if cause is not None else ""
        return (
            f"the Hub at {constants.ENDPOINT} is unreachable{detail} and the model is not in "
            f"the cache {constants.HF_HUB_CACHE}"
        )
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
