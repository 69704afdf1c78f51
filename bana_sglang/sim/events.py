"""The simulator's event kinds: the third field of every ``(time, seq, kind, a, b)``
entry of ``Simulation.events``; ``seq`` breaks time ties in push order."""

from __future__ import annotations

(PREFILL_DONE, PREFILL_TAIL, TRANSFER_DONE, DECODE_TICK, COLO_STEP, TICK, MIG_DONE, LEASE_END) = (
    range(8)
)
