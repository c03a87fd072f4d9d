"""Declare a command-line flag once, on a frozen config dataclass field, with its env var.

``max_num_seqs: int = flag(128, "...")`` becomes ``--max-num-seqs`` whose default is read from
``SPLITSERVE_MAX_NUM_SEQS`` when set. Services and Helm values use the same names.

An env value is parsed only when its flag is absent from the command line: Kubernetes injects
``<SERVICE>_PORT=tcp://...`` into pods (a Service named ``splitserve`` gives
``SPLITSERVE_PORT``), and ``--port`` must still win over it. A value that does not parse is
then a one-line error naming the variable, its value and the expected type (``parse_flags``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable, Sequence
from typing import Any

ENV_PREFIX = "SPLITSERVE_"
_MISSING = dataclasses.MISSING
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "text"}


class EnvValueError(ValueError):
    """A ``SPLITSERVE_*`` env var whose value does not parse as its flag's type."""


@dataclasses.dataclass(frozen=True, slots=True)
class EnvDefault:
    """A flag's default taken from its env var, still unparsed (see ``resolve``)."""

    var: str
    text: str
    kind: type
    choices: tuple[str, ...] | None

    def resolve(self) -> Any:
        """The parsed value; raises ``EnvValueError`` naming the variable."""
        expected = _TYPE_NAMES.get(self.kind, self.kind.__name__)
        try:
            value = _parse_bool(self.text) if self.kind is bool else self.kind(self.text)
        except (ValueError, argparse.ArgumentTypeError):
            raise EnvValueError(
                f"{self.var}={self.text!r} is not valid: expected {expected}"
            ) from None
        if self.choices is not None and value not in self.choices:
            raise EnvValueError(
                f"{self.var}={self.text!r} is not valid: expected one of {', '.join(self.choices)}"
            )
        return value


def flag(
    default: Any = _MISSING,
    help: str = "",
    *,
    choices: tuple[str, ...] | None = None,
    secret: bool = False,
) -> Any:
    """A dataclass field that is also a CLI flag (no default: the flag is required); a
    ``secret`` one is left out of the config's repr (and so of logs)."""
    return dataclasses.field(
        default=default, repr=not secret, metadata={"help": help, "choices": choices}
    )


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


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    skip: tuple[str, ...] = (),
    *,
    defaults: bool = True,
) -> None:
    """Add one flag per field of dataclass ``cls``; a set env var replaces the declared
    default (as an ``EnvDefault``, parsed by ``parse_flags`` / ``from_args`` only when the
    flag is not on the command line). ``defaults=False``: no defaults and no env vars, so
    that the parsed namespace holds exactly the flags given (overrides of a config)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        kind = _scalar_type(hints[f.name])
        env_value = os.environ.get(env_name(f.name)) if defaults else None
        default = f.default if defaults else argparse.SUPPRESS
        converter: Callable[[str], Any] = _parse_bool if kind is bool else kind
        if env_value is not None:
            default = EnvDefault(env_name(f.name), env_value, kind, f.metadata["choices"])
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


def resolve_env_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Parse, in place, every flag value still taken from its env var; raises
    ``EnvValueError`` for the first that does not parse."""
    for name, value in vars(args).items():
        if isinstance(value, EnvDefault):
            setattr(args, name, value.resolve())
    return args


def parse_flags(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with env defaults parsed; a bad env value exits with status
    2 and one line on stderr (no usage text: the command line was not at fault)."""
    args = parser.parse_args(argv)
    try:
        return resolve_env_defaults(args)
    except EnvValueError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def from_args(
    cls: type, args: argparse.Namespace, skip: tuple[str, ...] = (), **overrides: Any
) -> Any:
    """Build ``cls`` from parsed flags (fields absent from ``args`` or in ``skip`` keep their
    defaults). Env defaults not yet parsed are parsed here (``EnvValueError``)."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if hasattr(args, f.name) and f.name not in skip
    }
    values = {
        name: value.resolve() if isinstance(value, EnvDefault) else value
        for name, value in values.items()
    }
    values.update(overrides)
    return cls(**values)


def to_argv(config: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that ``add_flags`` + ``from_args`` turn back into ``config`` (None, secrets
    and the fields in ``skip``: omitted; pass secrets with ``secret_env``)."""
    argv: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if "help" not in f.metadata or value is None or f.name in skip or not f.repr:
            continue
        name = flag_name(f.name)
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        else:
            argv += [name, str(value)]
    return argv


def secret_env(config: Any) -> dict[str, str]:
    """The env vars that carry ``config``'s secret flags (those set), for a child process:
    argv is readable by every user of the machine, a process's environment is not."""
    return {
        env_name(f.name): str(getattr(config, f.name))
        for f in dataclasses.fields(config)
        if "help" in f.metadata and not f.repr and getattr(config, f.name)
    }
