"""The ``splitserve`` command: one sub-command per job."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from engine import cli as generate_cli
from services import client, launcher


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve", description="Disaggregated prefill/decode LLM serving."
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("SPLITSERVE_LOG_LEVEL", "WARNING"),
        help="logging level [env SPLITSERVE_LOG_LEVEL]",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    generate_cli.add_parser(subparsers)
    launcher.add_parser(subparsers)
    client.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
