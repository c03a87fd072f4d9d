"""The router's served models without worker processes: a request's model resolves to its
model or adapter, models are learnt from the workers that report them, each model has its own
limits and its own candidates, and runtime adapter loads are checked before any worker call."""

from __future__ import annotations

import asyncio
import logging
import random
import re
from typing import Any, cast

import pytest

from services.router.decode_choice import DecodeChooser
from services.router.latency import LatencyWindow
from services.router.lora_adapters import LoraAdapters, RuntimeUpdatesDisabledError
from services.router.served_models import ModelNotFoundError, ServedModel, ServedModels
from services.router.tool_calls.parsers import ToolCallFormat
from services.router.worker_pool import ServedTarget
from tests.services.router.fakes import DECODE, PREFILL, W, make_pool


class Factory:
    """Builds a served model without a tokenizer; records each (name, model, revision)."""

    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        self.calls: list[tuple[str, str, str | None]] = []
        self._failing = failing

    def __call__(self, name: str, model: str, revision: str | None) -> ServedModel:
        self.calls.append((name, model, revision))
        if name in self._failing:
            raise OSError(f"no tokenizer at {model}")
        return _served(name, model)


def _served(name: str, model: str) -> ServedModel:
    none = cast(Any, None)  # what these tests never reach: tokenizer, routing, metrics
    return ServedModel(name, model, none, ToolCallFormat.HERMES, none, none, LatencyWindow())


def _models(
    decode: list[W],
    prefill: list[W] | None = None,
    factory: Factory | None = None,
    allow_runtime_updates: bool = True,
) -> ServedModels:
    decode_pool = make_pool(DECODE, decode)
    pools = (make_pool(PREFILL, prefill or []), decode_pool)
    return ServedModels(
        _served("m", "/models/m"),
        pools,
        decode_pool,
        LoraAdapters(pools, allow_runtime_updates),
        factory or Factory(),
    )


def test_a_requests_model_resolves_to_its_model_or_adapter():
    models = _models([W("d0", model="m", lora_adapters=("ad",))])
    assert models.resolve("").served.name == "m"
    assert models.resolve("m").served.name == "m"
    resolved = models.resolve("ad")
    assert (resolved.served.name, resolved.lora_name, resolved.lora_block_key) == (
        "m",
        "ad",
        "ad@key",
    )
    expected = re.escape("`x` does not exist (served: `m`, `ad`)")
    with pytest.raises(ModelNotFoundError, match=expected):
        models.resolve("x")
    with pytest.raises(ModelNotFoundError) as info:
        models.resolve("y" * 100_000)
    assert len(str(info.value)) < 300


def test_a_model_is_learnt_once_from_the_workers_that_report_it():
    factory = Factory()
    models = _models(
        [W("d0", model="m"), W("d1", model="b", lora_adapters=("b-ad",))],
        prefill=[W("p1", model="b")],
        factory=factory,
    )
    with pytest.raises(ModelNotFoundError):
        models.resolve("b")
    asyncio.run(models.discover())
    asyncio.run(models.discover())
    assert factory.calls == [("b", "/models/b", None)]
    assert models.names() == ["m", "b"]
    assert models.resolve("b").served.name == "b"
    # An adapter belongs to the model of the workers serving it.
    assert models.resolve("b-ad").served.name == "b"


def test_a_model_whose_tokenizer_does_not_load_is_not_served_and_not_retried(caplog):
    factory = Factory(failing=frozenset({"b"}))
    models = _models([W("d0", model="m"), W("d1", model="b")], factory=factory)
    with caplog.at_level(logging.ERROR):
        asyncio.run(models.discover())
        asyncio.run(models.discover())
    assert factory.calls == [("b", "/models/b", None)]
    assert models.names() == ["m"]
    assert "model b (/models/b, reported by decode worker d1) is not served" in caplog.text
    with pytest.raises(ModelNotFoundError):
        models.resolve("b")


def test_each_model_has_its_own_latency_window():
    models = _models([W("d0", model="m"), W("d1", model="b")])
    asyncio.run(models.discover())
    b = models.get("b")
    assert b is not None
    b.latency.add_ttft(0.5)
    taken = models.take_latency_samples()
    assert (taken["m"].ttft_s, taken["b"].ttft_s) == ([], [0.5])
    assert models.take_latency_samples()["b"].ttft_s == []


def test_each_model_has_its_own_limits():
    models = _models([W("d0", model="m", max_model_len=300), W("d1", model="b", max_model_len=64)])
    asyncio.run(models.discover())
    m_limits, b_limits = models.limits("m"), models.limits("b")
    assert m_limits is not None and b_limits is not None
    assert (m_limits.max_model_len, b_limits.max_model_len) == (300, 64)
    assert models.limits("none") is None


def test_a_request_is_only_offered_its_models_workers():
    pool = make_pool(DECODE, [W("m0", model="m"), W("b0", model="b"), W("b1", model="b")])
    chooser = DecodeChooser(pool, load_weight=1.0, move_weight=1.0, rng=random.Random(0))
    # The same prompt blocks cached on a worker of the other model count for nothing.
    matched = {"m0": 4, "b1": 2}
    for target, expected in [
        (ServedTarget("m"), {"m0"}),
        (ServedTarget("b"), {"b0", "b1"}),
        (ServedTarget("c"), set()),
    ]:
        scored = chooser.score(4, matched, target=target)
        assert {c.worker.address for c in scored} == expected
    best = chooser.choose(4, matched, target=ServedTarget("b"))
    assert best is not None and (best.worker.address, best.matched_blocks) == ("b1", 2)


def test_runtime_adapter_loads_are_refused_unless_allowed():
    models = _models([W("d0")], allow_runtime_updates=False)
    with pytest.raises(RuntimeUpdatesDisabledError, match="--allow-runtime-lora-updating"):
        asyncio.run(models.load_adapter("x", "/adapters/x"))
    with pytest.raises(RuntimeUpdatesDisabledError):
        asyncio.run(models.adapters.unload("x"))


def test_an_adapter_load_names_what_is_wrong_before_calling_any_worker():
    models = _models([W("d0", model="m", healthy=False)])
    with pytest.raises(ValueError, match="already served"):
        asyncio.run(models.load_adapter("m", "/adapters/x"))
    with pytest.raises(ValueError, match="printable characters"):
        asyncio.run(models.load_adapter("a b", "/adapters/x"))
    with pytest.raises(ValueError, match=re.escape("base_model_name: `c` is not served")):
        asyncio.run(models.load_adapter("x", "/adapters/x", base_model="c"))
    with pytest.raises(ValueError, match="no worker of model `m` has answered yet"):
        asyncio.run(models.load_adapter("x", "/adapters/x"))
