"""The router's adapter registry without workers: model names and the runtime-update switch."""

from __future__ import annotations

import asyncio
import re

import pytest

from services.common.roles import Role
from services.router.lora_adapters import (
    LoraAdapters,
    ModelNotFoundError,
    RuntimeUpdatesDisabledError,
)
from services.router.worker_pool import WorkerPool


def _adapters(allow: bool) -> LoraAdapters:
    return LoraAdapters("served-model", (WorkerPool(Role.DECODE, ()),), allow)


def test_the_served_model_resolves_to_no_adapter():
    adapters = _adapters(True)
    assert adapters.resolve("") == ("", "")
    assert adapters.resolve("served-model") == ("", "")
    expected = re.escape("`x` does not exist (served: `served-model`)")
    with pytest.raises(ModelNotFoundError, match=expected):
        adapters.resolve("x")
    with pytest.raises(ModelNotFoundError) as info:
        adapters.resolve("y" * 100_000)
    assert len(str(info.value)) < 300


def test_runtime_updates_are_refused_unless_allowed():
    adapters = _adapters(False)
    with pytest.raises(RuntimeUpdatesDisabledError, match="--allow-runtime-lora-updating"):
        asyncio.run(adapters.load("x", "/adapters/x"))
    with pytest.raises(RuntimeUpdatesDisabledError):
        asyncio.run(adapters.unload("x"))


def test_a_load_names_what_is_wrong_before_calling_any_worker():
    adapters = _adapters(True)
    with pytest.raises(ValueError, match="already served"):
        asyncio.run(adapters.load("served-model", "/adapters/x"))
    with pytest.raises(ValueError, match="printable characters"):
        asyncio.run(adapters.load("a b", "/adapters/x"))
    with pytest.raises(ValueError, match="no worker has answered yet"):
        asyncio.run(adapters.load("x", "/adapters/x"))
