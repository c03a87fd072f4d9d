"""Choosing a KV transfer backend by name: what exists, what is installed, the default."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.kv_cache_spec import KVCacheSpec
from kvtransfer import registry
from kvtransfer.registry import BACKENDS, available_backends, default_backend, make_backend

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")


@pytest.mark.parametrize("name", available_backends())
def test_make_backend_builds_each_available_backend(name):
    backend = make_backend(name, f"made-{name}", advertise_host="kv.example")
    try:
        assert backend.name == name
        info = backend.register_kv_cache(
            torch.zeros((2, *SPEC.block_shape), dtype=torch.bfloat16), SPEC
        )
        assert info.backend == name and info.compat_hash == SPEC.compat_hash()
        if name in ("tcp", "ucx"):
            assert info.address.startswith("kv.example:")
    finally:
        backend.close()


def test_tcp_and_inproc_are_always_available_and_unknown_names_list_the_choices():
    assert BACKENDS == ("nixl", "ucx", "tcp", "inproc")
    assert {"tcp", "inproc"} <= set(available_backends())
    with pytest.raises(ValueError, match=r"'nope'.*'nixl', 'ucx', 'tcp', 'inproc'"):
        make_backend("nope", "x")


def test_default_is_nixl_when_installed_else_tcp(monkeypatch):
    installed = importlib.util.find_spec("nixl") is not None
    assert default_backend() == ("nixl" if installed else "tcp")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        registry.importlib.util,
        "find_spec",
        lambda module: None if module in ("nixl", "ucxx") else real_find_spec(module),
    )
    assert default_backend() == "tcp"
    assert available_backends() == ("tcp", "inproc")
    with pytest.raises(ValueError, match=r"needs the 'nixl' package.*splitserve\[nixl\]"):
        make_backend("nixl", "x")
