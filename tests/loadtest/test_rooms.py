"""``loadtest/``'s rooms import downward only (docs/architecture.md): the load generator and the
fixtures import no other room, the benchmarks import those two, and the chaos harness and the
comparisons import those three, never each other. Read from every module's imports (AST)."""

from __future__ import annotations

import ast
from pathlib import Path

import loadtest

ROOT = Path(loadtest.__file__).parent
ALLOWED = {
    "generator": set(),
    "fixtures": set(),
    "bench": {"generator", "fixtures"},
    "chaos": {"generator", "fixtures", "bench"},
    "comparisons": {"generator", "fixtures", "bench"},
}


def _rooms_imported(path: Path) -> set[str]:
    """The rooms ``path`` imports from (``loadtest.<room>...``), at any depth of the module."""
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + (
                [f"{node.module}.{a.name}" for a in node.names] if node.module == "loadtest" else []
            )
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "loadtest" and len(parts) > 1:
                rooms.add(parts[1])
    return rooms


def test_every_module_is_in_a_room():
    assert sorted(p.name for p in ROOT.glob("*.py")) == ["__init__.py"]
    assert {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} == set(ALLOWED)


def test_rooms_import_downward_only():
    wrong = {
        str(path.relative_to(ROOT)): sorted(outside)
        for room, allowed in ALLOWED.items()
        for path in (ROOT / room).rglob("*.py")
        if (outside := _rooms_imported(path) - allowed - {room})
    }
    assert wrong == {}
