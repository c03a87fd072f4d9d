"""The ``splitserve`` command: one sub-command per job.

Sub-commands load lazily: only the module of the command being run is imported, so
``splitserve status`` or ``client`` never import torch, Ray or the load generator.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.flags import parse_flags
from services.common.logs import add_log_flags, configure_logging


@dataclass(frozen=True, slots=True)
class Command:
    """A sub-command: ``module.configure`` declares its flags and sets ``func`` on the parser."""

    name: str
    module: str
    configure: str
    help: str


COMMANDS = (
    Command(
        "generate",
        "engine.cli",
        "configure",
        "generate a completion offline with the engine in this process",
    ),
    Command(
        "up",
        "services.up",
        "configure",
        "start a router plus prefill and decode pools (Ray actors; --no-ray: processes)",
    ),
    Command("client", "services.client", "configure", "stream a generation from a running router"),
    Command(
        "status",
        "services.admin",
        "configure_status",
        "pools, workers, health, load and KV usage of a running cluster",
    ),
    Command(
        "scale",
        "services.admin",
        "configure_scale",
        "set the number of prefill or decode workers of a running cluster",
    ),
    Command(
        "certs",
        "services.certs",
        "configure",
        "write a cluster CA and per-identity TLS certificates (for --tls-dir)",
    ),
    Command(
        "loadtest",
        "loadtest.generator.cli",
        "configure",
        "open-loop load against a running router; JSON, Markdown and PNG reports",
    ),
)


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; the flags of ``commands`` (default: all) are declared, the
    other sub-commands are listed with their help only (and so import nothing)."""
    loaded = {c.name for c in COMMANDS} if commands is None else set(commands)
    parser = argparse.ArgumentParser(
        prog="splitserve", description="Disaggregated prefill/decode LLM serving."
    )
    add_log_flags(parser, default="WARNING")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        if command.name in loaded:
            getattr(importlib.import_module(command.module), command.configure)(sub)
    return parser


def chosen_command(argv: Sequence[str]) -> str | None:
    """The sub-command named on ``argv`` (None when there is none, e.g. ``--help``)."""
    prefix = argparse.ArgumentParser(add_help=False)
    add_log_flags(prefix, default="WARNING")
    prefix.add_argument("command", nargs="?")
    known, _ = prefix.parse_known_args(argv)
    return known.command


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = chosen_command(argv)
    args = parse_flags(build_parser([command] if command else []), argv)
    configure_logging(args.log_level, args.log_format)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
