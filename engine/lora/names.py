"""Adapter names and ``--lora-modules``: torch-free, for the router and the config."""

from __future__ import annotations


def check_adapter_name(name: str) -> None:
    """``ValueError`` unless ``name`` can name an adapter (it is also a model name clients
    send): 1 to 128 characters, no whitespace or control characters."""
    if not 1 <= len(name) <= 128 or any(c.isspace() or not c.isprintable() for c in name):
        raise ValueError(
            f"LoRA adapter name {name!r}: 1 to 128 printable characters without spaces"
        )


def parse_lora_modules(spec: str) -> list[tuple[str, str]]:
    """``--lora-modules`` (``name=path,name=path``) as ``(name, path)`` pairs, in order;
    ``ValueError`` naming the flag when an entry is malformed or a name repeats."""
    modules: list[tuple[str, str]] = []
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {entry!r} is not name=path")
        check_adapter_name(name)
        if any(name == seen for seen, _ in modules):
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        modules.append((name, path))
    return modules
