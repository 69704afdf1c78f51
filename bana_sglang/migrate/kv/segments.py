"""What a KV-block lender keeps track of: the segments on a host, the pages
picked for a move, the per-migration statistics, and the carve of a remote
range out of the ranges SGLang frees (:mod:`.lender` uses them all)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Segment:
    migration: str
    rid: str
    row: int  # req_to_token row (req_pool_idx)
    start: int  # positions [start, stop) are on the host
    stop: int
    addr: int = 0  # where the host holds it
    state: str = "remote"  # remote | lost

    @property
    def tokens(self) -> int:
        return self.stop - self.start


@dataclass
class Pick:
    """A request's pages chosen for migration (scheduler thread)."""

    req: object
    start: int
    stop: int


@dataclass
class KVStats:
    segments: int = 0  # moved
    pages: int = 0
    bytes_out: int = 0
    recalled: int = 0  # segments read back
    recalled_bytes: int = 0
    dropped: int = 0  # segments whose KV could not come back (no memory, host lost)
    backed_up: int = 0  # segments written into SGLang's retraction backup of their request
    attend_calls: int = 0
    attend_s: float = 0.0  # D's wall time waiting for the host's partial attention
    host_s: float = 0.0  # the host's compute time
    move_s: float = 0.0  # the stall of the copy at the batch boundary
    # the allocator's free slots just before and after the move (same boundary)
    free_before: int = -1
    free_after: int = -1

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def carve_ranges(ranges: list[tuple[int, int]], cut: tuple[int, int]) -> list[tuple[int, int]]:
    """``ranges`` (ascending, disjoint, half-open) minus ``cut``."""
    a, b = cut
    out = []
    for s, e in ranges:
        if e <= a or s >= b:
            out.append((s, e))
            continue
        if s < a:
            out.append((s, a))
        if e > b:
            out.append((b, e))
    return out
