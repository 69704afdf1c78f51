"""What every ``python -m bana_sglang.*`` command does first."""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def byte_size(text: str) -> int:
    """``512M``, ``4G``, ``64KiB`` or plain bytes, for argparse ``type=``."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 512M, 4G)") from None


#: the smallest segment Mooncake mounts ("Total size must be at least 16777216")
MIN_SEGMENT_BYTES = 16 << 20


def segment_size(text: str) -> int:
    """:func:`byte_size` of a Mooncake segment: at least :data:`MIN_SEGMENT_BYTES`
    (a smaller one is refused by Mooncake at every try, and its process never comes up)."""
    n = byte_size(text)
    if n < MIN_SEGMENT_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is below the smallest Mooncake segment, 16M ({MIN_SEGMENT_BYTES} bytes)"
        )
    return n


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit`` so that ``with Cluster(...)`` blocks unwind
    and stop every process they started (Python's default SIGTERM action exits
    without running them, leaving SGLang's grandchildren orphaned)."""

    def on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


def parse(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    to_config: Callable[[argparse.Namespace], T],
) -> tuple[argparse.Namespace, T]:
    """Parse ``argv``, set up logging from ``--log-level``, and build the config;
    a config that refuses the arguments (ValueError) becomes a usage error."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    try:
        return args, to_config(args)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
