"""Regenerate the committed Python stubs of ``proto/splitserve/v1/*.proto``.

Run ``python proto/generate.py`` after editing a ``.proto`` file; ``tests/proto`` fails while the
committed stubs differ from what this produces. The stubs import each other as ``splitserve.v1``,
the package that ``pyproject.toml`` maps onto ``proto/splitserve``.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "splitserve" / "v1"
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PACKAGE_DIR.glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Write the stubs of every .proto under ``out_root/splitserve/v1``; return their paths."""
    from grpc_tools import protoc  # build-time only dependency (grpcio-tools)

    out_root.mkdir(parents=True, exist_ok=True)
    sources = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    out_dir = out_root / "splitserve" / "v1"
    return sorted(p for p in out_dir.iterdir() if p.name.endswith(STUB_SUFFIXES))


def main(argv: list[str]) -> int:
    """``python proto/generate.py [OUT_ROOT]``: regenerate in place, or under ``OUT_ROOT``."""
    out_root = Path(argv[0]) if argv else PROTO_ROOT
    for path in generate(out_root):
        print(path.relative_to(out_root.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
