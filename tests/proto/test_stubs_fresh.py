"""The committed stubs in proto/splitserve/v1 are exactly what proto/generate.py produces."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_generator():
    spec = importlib.util.spec_from_file_location("proto_generate", REPO / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_proto_sources(tmp_path):
    generate = load_generator()
    fresh = {p.name: p.read_bytes() for p in generate.generate(tmp_path)}
    committed = {
        p.name: p.read_bytes()
        for p in generate.PACKAGE_DIR.iterdir()
        if p.name.endswith(generate.STUB_SUFFIXES)
    }
    assert sorted(fresh) == sorted(committed), "a .proto was added or removed without regenerating"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run `python proto/generate.py`"


def test_stubs_import_as_splitserve_v1():
    from splitserve.v1 import router_pb2, router_pb2_grpc, worker_pb2_grpc

    assert router_pb2.DESCRIPTOR.package == "splitserve.v1"
    assert hasattr(router_pb2_grpc, "RouterStub")
    assert hasattr(worker_pb2_grpc, "PrefillWorkerStub") and hasattr(
        worker_pb2_grpc, "DecodeWorkerStub"
    )
