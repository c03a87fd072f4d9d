"""The command line of one service process (``python -m services.<role>``).

Every service takes its own config's flags, the Redis and tracing flags it shares with the
others, and the log flags; this parses them and configures logging before anything logs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from engine.flags import add_flags, from_args, parse_flags
from services.common.logs import add_log_flags, configure_logging
from services.common.redis_config import RedisConfig
from services.common.tracing import TracingConfig


def parse_service_args(
    prog: str, description: str, configs: Sequence[type], argv: list[str] | None
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Parse ``argv`` (None: ``sys.argv``) against the flags of ``configs`` (frozen config
    dataclasses) plus Redis, tracing and logging, and configure logging from them. Returns
    the parser (for ``parser.error``) and the parsed flags. Exits (status 2) on a bad flag or
    a bad environment value, naming it."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for config in (*configs, RedisConfig, TracingConfig):
        add_flags(parser, config)
    add_log_flags(parser)
    args = parse_flags(parser, argv)
    configure_logging(args.log_level, args.log_format)
    return parser, args


def shared_configs(args: argparse.Namespace) -> tuple[RedisConfig, TracingConfig]:
    """The ``redis`` and ``tracing`` fields of a service's config, from its parsed flags."""
    return from_args(RedisConfig, args), from_args(TracingConfig, args)
