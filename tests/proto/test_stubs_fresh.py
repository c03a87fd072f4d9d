"""The committed stubs in proto/splitserve/v1 are exactly what proto/generate.py produces."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GENERATOR = REPO / "proto" / "generate.py"


def load_generator():
    """proto/generate.py as a module, for its constants (importing it runs no protoc)."""
    spec = importlib.util.spec_from_file_location("proto_generate", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_proto_sources(tmp_path):
    # In a child process: protoc's C++ runtime crashes in a process that has loaded NIXL's
    # libraries (both carry their own protobuf), which earlier tests of this session may have.
    subprocess.run([sys.executable, str(GENERATOR), str(tmp_path)], check=True)
    generate = load_generator()
    suffixes = generate.STUB_SUFFIXES
    fresh_dir = tmp_path / "splitserve" / "v1"
    fresh = {p.name: p.read_bytes() for p in fresh_dir.iterdir() if p.name.endswith(suffixes)}
    committed = {
        p.name: p.read_bytes() for p in generate.PACKAGE_DIR.iterdir() if p.name.endswith(suffixes)
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
