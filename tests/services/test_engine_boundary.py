"""The workers reach their engine through ``EngineBackend`` only: no module under ``services/``
uses an engine attribute outside it or imports an implementation (the runtime gets its engine
from ``engine.build``; ``engine/backend.py`` says why)."""

from __future__ import annotations

import ast
from pathlib import Path

from engine.backend import EngineBackend

SERVICES = Path(__file__).resolve().parents[2] / "services"
# The one module that builds an engine; everything else gets an EngineBackend.
_BUILDS_THE_ENGINE = SERVICES / "worker" / "runtime.py"
_IMPLEMENTATIONS = ("engine.llm_engine", "engine.vllm_engine.engine")


def _members() -> set[str]:
    names = set(getattr(EngineBackend, "__protocol_attrs__", ()))
    names |= {n for n in vars(EngineBackend) if not n.startswith("_")}
    names |= set(EngineBackend.__annotations__)
    return names


def _is_engine(node: ast.expr) -> bool:
    """``engine`` or ``<...>.engine``, but not an ``EngineConfig`` (``config.engine``)."""
    if isinstance(node, ast.Name):
        return node.id == "engine"
    if isinstance(node, ast.Attribute) and node.attr == "engine":
        inner = node.value
        config = (isinstance(inner, ast.Name) and inner.id == "config") or (
            isinstance(inner, ast.Attribute) and inner.attr == "config"
        )
        return not config
    return False


def _engine_uses(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) of each attribute read off an engine in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and _is_engine(node.value)
    ]


def _worker_modules() -> list[Path]:
    """Modules that hold an engine: they name the protocol."""
    return [p for p in sorted(SERVICES.rglob("*.py")) if "EngineBackend" in p.read_text()]


def test_the_protocol_is_what_the_workers_use() -> None:
    assert _members() >= {"add_request", "step", "info", "kv_cache", "on_constraint_compiled"}
    modules = _worker_modules()
    assert _BUILDS_THE_ENGINE in modules and len(modules) >= 5
    outside = [
        f"{path.relative_to(SERVICES.parent)}:{line}: engine.{attr}"
        for path in modules
        for line, attr in _engine_uses(path)
        if attr not in _members()
    ]
    assert not outside, "engine attributes outside EngineBackend:\n" + "\n".join(outside)


def test_no_service_imports_an_engine_implementation() -> None:
    importers = []
    for path in sorted(SERVICES.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if any(name in _IMPLEMENTATIONS for name in names):
                importers.append(str(path.relative_to(SERVICES.parent)))
    assert not importers, f"{importers} import an engine: take an EngineBackend instead"


def test_a_use_outside_the_protocol_is_found(tmp_path: Path) -> None:
    module = tmp_path / "leaky.py"
    module.write_text(
        "def peek(runtime, config):\n"
        "    runtime.engine.scheduler.waiting\n"
        "    config.engine.block_size\n"
        "    return runtime.engine.stats()\n"
    )
    assert [(line, attr) for line, attr in _engine_uses(module) if attr not in _members()] == [
        (2, "scheduler")
    ]
