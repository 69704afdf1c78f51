"""What every benchmark shares to state and publish its numbers: the machine's
description, the options of a single-cluster benchmark, and the writer of
``docs/RESULTS.md`` (each command owns one marked section, replaced by its next run).
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

from bana_sglang import _cli

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
RESULTS_MD = ROOT / "docs" / "RESULTS.md"


def machine_description() -> str:
    """One line on this machine for a report: CPU, memory, versions and the load average now."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = float("nan")
    import sglang
    import torch

    load = os.getloadavg()
    return (
        f"{platform.node()}: {os.cpu_count()} CPU cores ({cpu}), {mem_gb:.0f} GiB RAM, no GPU used; "
        f"Linux {platform.release()}, Python {platform.python_version()}, sglang {sglang.__version__}, "
        f"torch {torch.__version__}; load average at the start {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} "
        f"(the machine is shared with other engineers' tests: absolute numbers are noisy)"
    )


def parse_cluster_bench_args(p, argv, default_port: int = 31000):
    """The options every single-cluster benchmark shares (``--port``, ``--out``,
    ``--write-results``, ``--log-level``), parsed with the project's logging set
    up; a SIGTERM ends the run cleanly (its cluster stops)."""
    p.add_argument("--port", type=int, default=default_port)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--log-level", default="INFO")
    args, _ = _cli.parse(p, list(argv) if argv is not None else None, lambda a: None)
    _cli.exit_on_sigterm()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return args


def write_results_section(section: str, title: str, body: str, path: Path = RESULTS_MD) -> None:
    """Replace (or append) the section between this section's markers."""
    begin, end = f"<!-- bench:{section}:begin -->", f"<!-- bench:{section}:end -->"
    block = f"{begin}\n## {title}\n\n{body}\n{end}"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (
        path.read_text()
        if path.exists()
        else (
            "# Benchmark results\n\nWritten by `python -m bench` (bench/results.py), not by hand: each section "
            "is replaced by the next run of its command.\n\n"
        )
    )
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
    logger.info("wrote section %s of %s", section, path)
