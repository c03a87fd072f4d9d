"""Hugging Face repo ids: loaded from a real on-disk hub cache with no network, or a clear error.

The Hub is never reachable here. A cached model is loaded with the endpoint pointed at a local
listener that nobody answers, which records any attempt to reach it (there must be none); a
missing one with the endpoint on a closed port, so that the attempt fails at once.
huggingface_hub reads its env vars when imported: this process gets its ``constants``
patched, subprocesses get the env vars.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from huggingface_hub import constants
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.loader.hub import ModelFetchError, is_repo_id
from engine.loader.models import resolve_model
from loadtest.fixtures.tiny_model import make_tiny_model
from tests.engine.loader.hf_cache import add_snapshot, commit_hash, repo_dir

REPO = "tiny-org/tiny-llama"
CLOSED_ENDPOINT = "http://127.0.0.1:9"  # the discard port: nothing listens, connecting fails
PROMPT = [5, 17, 42, 99, 7, 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass(slots=True)
class OfflineHub:
    """An empty hub cache, and the Hub's endpoint on a listener that never answers."""

    cache: Path
    endpoint: str
    listener: socket.socket

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The environment of a subprocess that uses this cache and endpoint."""
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_HOME")}
        return env | {"HF_HUB_CACHE": str(self.cache), "HF_ENDPOINT": endpoint or self.endpoint}

    def was_contacted(self) -> bool:
        """Whether anything connected to the endpoint (the kernel completes the handshake)."""
        try:
            connection, _ = self.listener.accept()
        except BlockingIOError:
            return False
        connection.close()
        return True


def _point_hub_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[OfflineHub]:
    cache = tmp_path / "hf-cache" / "hub"
    cache.mkdir(parents=True)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        _point_hub_at(monkeypatch, endpoint)
        yield OfflineHub(cache, endpoint, listener)


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny llama (other weights, same tokenizer): a second revision of the repo."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-v2"), "llama", seed=1)


def _greedy_tokens(model: str, **engine_kwargs: str) -> list[int]:
    llm = LLM(model, dtype="float32", num_kv_blocks=64, **engine_kwargs)
    return llm.generate([PROMPT], GREEDY)[0].token_ids


def test_cached_repo_id_loads_and_generates_without_network(
    hub: OfflineHub, tiny_llama_dir: Path
) -> None:
    snapshot = add_snapshot(hub.cache, REPO, tiny_llama_dir, commit_hash("v1"))
    assert (snapshot / "model.safetensors").is_symlink()

    llm = LLM(REPO, dtype="float32", num_kv_blocks=64)
    assert llm.engine.model_dir == snapshot
    assert llm.engine.served_model_name == REPO
    got = llm.generate([PROMPT], GREEDY)[0].token_ids
    assert got == _greedy_tokens(str(tiny_llama_dir))
    assert len(got) == GREEDY.max_tokens
    assert not hub.was_contacted()


def test_revision_selects_the_snapshot(
    hub: OfflineHub, tiny_llama_dir: Path, second_model_dir: Path
) -> None:
    first = add_snapshot(hub.cache, REPO, tiny_llama_dir, commit_hash("v1"))
    second = add_snapshot(hub.cache, REPO, second_model_dir, commit_hash("v2"), refs=("v2",))
    assert resolve_model(REPO) == first
    assert resolve_model(REPO, revision="main") == first
    assert resolve_model(REPO, revision="v2") == second
    assert resolve_model(REPO, revision=commit_hash("v2")) == second

    want = _greedy_tokens(str(second_model_dir))
    assert want != _greedy_tokens(str(tiny_llama_dir))  # else the check below proves nothing
    assert _greedy_tokens(REPO, revision="v2") == want
    assert not hub.was_contacted()


def test_offline_mode_uses_the_cache(
    hub: OfflineHub, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = add_snapshot(hub.cache, REPO, tiny_llama_dir, commit_hash("v1"))
    assert resolve_model(REPO) == snapshot
    with pytest.raises(ModelFetchError, match=r"not in the cache .* HF_HUB_OFFLINE is set"):
        resolve_model(REPO, revision="v9")
    assert not hub.was_contacted()


def test_unreachable_hub_and_nothing_cached_is_a_one_line_error(
    hub: OfflineHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    _point_hub_at(monkeypatch, CLOSED_ENDPOINT)
    with pytest.raises(ModelFetchError) as excinfo:
        resolve_model("tiny-org/missing")
    message = str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert "\n" not in message
    assert message.startswith("cannot fetch Hugging Face model tiny-org/missing: ")
    assert f"{CLOSED_ENDPOINT} is unreachable" in message and str(hub.cache) in message


def test_a_snapshot_without_weights_serves_only_the_tokenizer(
    hub: OfflineHub, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a router fetched (tokenizer files) is not a model for a worker: the worker goes
    for the rest (here offline mode forbids it; an unreachable Hub is the same error after
    huggingface_hub's retries)."""
    snapshot = add_snapshot(
        hub.cache, REPO, tiny_llama_dir, commit_hash("v1"), files=TOKENIZER_FILES
    )
    assert resolve_model(REPO, tokenizer_only=True) == snapshot
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelFetchError, match="not in the cache"):
        resolve_model(REPO)
    assert not hub.was_contacted()


def test_sharded_repo_needs_every_indexed_shard_and_loads_only_those(
    hub: OfflineHub, tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.save_pretrained(sharded, max_shard_size="200KB")
    shards = sorted(
        json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()
    )
    assert len(set(shards)) > 1
    for name in TOKENIZER_FILES:
        (sharded / name).write_bytes((tiny_llama_dir / name).read_bytes())
    # Another layout of the same weights beside the HF one, as in Mistral's repos: ignored.
    (sharded / "consolidated.safetensors").write_bytes(b"not the HF checkpoint")
    commit = commit_hash("sharded")
    snapshot = add_snapshot(hub.cache, REPO, sharded, commit)

    (snapshot / shards[-1]).unlink()  # an interrupted download
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelFetchError, match="not in the cache"):
        resolve_model(REPO)
    add_snapshot(hub.cache, REPO, sharded, commit, files=[shards[-1]])
    assert _greedy_tokens(REPO) == _greedy_tokens(str(tiny_llama_dir))
    assert not hub.was_contacted()


@pytest.mark.parametrize(
    "name", ["org/name", "HuggingFaceTB/SmolLM2-135M-Instruct", "meta-llama/Llama-3.1-8B"]
)
def test_org_slash_name_is_a_repo_id(name: str) -> None:
    assert is_repo_id(name)


def test_missing_paths_are_not_taken_for_repo_ids(hub: OfflineHub) -> None:
    for name in ("./model", "model/", "../org/name", "~/model", "a/b/c"):
        assert not is_repo_id(name)
        with pytest.raises(ValueError, match="unknown model"):
            resolve_model(name)
    assert not hub.was_contacted()


def test_revision_needs_a_repo_id(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="--revision applies to a Hugging Face repo id"):
        resolve_model(str(tiny_llama_dir), revision="v2")


def _generate_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable, "-m", "services.cli", "generate", "--dtype", "float32",
        "--num-kv-blocks", "64", "--max-tokens", "8", "--json", *args,
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)


def test_cli_loads_a_cached_repo_id_without_network(hub: OfflineHub, tiny_llama_dir: Path) -> None:
    add_snapshot(hub.cache, REPO, tiny_llama_dir, commit_hash("v1"))
    # HF_HOME alone places the cache at $HF_HOME/hub, as huggingface_hub documents.
    env = hub.env() | {"HF_HOME": str(hub.cache.parent)}
    del env["HF_HUB_CACHE"]
    proc = _generate_cli(env, "--model", REPO, "--prompt", "Hello world")
    assert proc.returncode == 0, proc.stderr
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    want = llm.generate(["Hello world"], GREEDY)[0]
    assert json.loads(proc.stdout)["token_ids"] == want.token_ids
    assert not hub.was_contacted()


def test_cli_missing_repo_is_one_error_line(hub: OfflineHub) -> None:
    proc = _generate_cli(
        hub.env(CLOSED_ENDPOINT), "--model", "tiny-org/missing", "--prompt", "Hello"
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: cannot fetch"), proc.stderr
    assert f"{CLOSED_ENDPOINT} is unreachable" in errors[0]
    assert not repo_dir(hub.cache, "tiny-org/missing").joinpath("snapshots").exists()
