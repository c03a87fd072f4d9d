"""Declare a command-line flag once, on a frozen config dataclass field, with its env var.

``max_num_seqs: int = flag(128, "...")`` becomes ``--max-num-seqs`` whose default is read from
``SPLITSERVE_MAX_NUM_SEQS`` when set. Services and Helm values use the same names.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any

ENV_PREFIX = "SPLITSERVE_"
_MISSING = dataclasses.MISSING


def flag(default: Any = _MISSING, help: str = "", *, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field that is also a CLI flag (no default: the flag is required)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _scalar_type(annotation: Any) -> type:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per field of dataclass ``cls`` (env var overrides the declared default)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        kind = _scalar_type(hints[f.name])
        env_value = os.environ.get(env_name(f.name))
        default = f.default
        converter = _parse_bool if kind is bool else kind
        if env_value is not None:
            default = converter(env_value)
        help_text = f"{f.metadata['help']} [env {env_name(f.name)}]"
        kwargs: dict[str, Any] = {"dest": f.name, "help": help_text}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = converter
            kwargs["choices"] = f.metadata["choices"]
        if default is _MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        parser.add_argument(flag_name(f.name), **kwargs)


def from_args(
    cls: type, args: argparse.Namespace, skip: tuple[str, ...] = (), **overrides: Any
) -> Any:
    """Build ``cls`` from parsed flags (fields absent from ``args`` or in ``skip`` keep their
    defaults)."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if hasattr(args, f.name) and f.name not in skip
    }
    values.update(overrides)
    return cls(**values)


def to_argv(config: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that ``add_flags`` + ``from_args`` turn back into ``config`` (None and the
    fields in ``skip``: omitted)."""
    argv: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if "help" not in f.metadata or value is None or f.name in skip:
            continue
        name = flag_name(f.name)
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        else:
            argv += [name, str(value)]
    return argv
