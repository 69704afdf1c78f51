"""What every ``python -m bana_sglang.*`` command does first."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def parse(parser: argparse.ArgumentParser, argv: list[str] | None,
          to_config: Callable[[argparse.Namespace], T]) -> tuple[argparse.Namespace, T]:
    """Parse ``argv``, set up logging from ``--log-level``, and build the config;
    a config that refuses the arguments (ValueError) becomes a usage error."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    try:
        return args, to_config(args)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
