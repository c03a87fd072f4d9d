"""The ``splitserve`` command: one sub-command per job."""

from __future__ import annotations

import argparse
import sys

from engine import cli as generate_cli
from engine.flags import parse_flags
from loadtest import cli as loadtest_cli
from services import admin, client, up
from services.common.logs import add_log_level_flag, configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve", description="Disaggregated prefill/decode LLM serving."
    )
    add_log_level_flag(parser, default="WARNING")
    subparsers = parser.add_subparsers(dest="command", required=True)
    generate_cli.add_parser(subparsers)
    up.add_parser(subparsers)
    client.add_parser(subparsers)
    admin.add_parsers(subparsers)
    loadtest_cli.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_flags(build_parser(), argv)
    configure_logging(args.log_level)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
