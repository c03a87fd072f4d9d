"""Logging setup shared by every splitserve process."""

from __future__ import annotations

import argparse
import logging
import os


def add_log_level_flag(parser: argparse.ArgumentParser, default: str = "INFO") -> None:
    parser.add_argument(
        "--log-level",
        default=os.environ.get("SPLITSERVE_LOG_LEVEL", default),
        help="logging level [env SPLITSERVE_LOG_LEVEL]",
    )


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
