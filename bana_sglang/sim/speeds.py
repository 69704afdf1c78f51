"""Worker speeds inside the simulation (a mixin of ``Simulation``): host contention
between workers that share cores, and the multiplicative speed factors that
contention and leases apply.

On a shared host (``SimConfig.shared_host``) each worker's prefill and decode
times are scaled by ``Profile.shared_host_factors`` of the number of *other*
workers computing; whenever a worker turns busy or idle every worker's factors
are recomputed, a running prefill chunk's remaining time is rescaled and a decode
batch is rescheduled at its new step time (processor sharing).
"""

from __future__ import annotations

from bana_sglang.sim.cluster import Worker
from bana_sglang.sim.events import PREFILL_DONE


class SpeedsMixin:
    """Uses the engine's clock (``now``), ``workers``, profile ``p``, config ``cfg``,
    the ``_contending``/``_again`` flags, and its ``_push`` and ``_reschedule``."""

    def _busy(self, w: Worker, busy: bool) -> None:
        """Mark ``w`` computing or idle; on a shared host, the others' speeds follow."""
        was = w.busy_from is not None
        w.set_busy(self.now, busy)
        if self.cfg.shared_host and was != busy:
            self._contend()

    def _contend(self) -> None:
        """Every worker's slowdown from the others computing on the same cores: a
        running prefill chunk's remaining time and the decode step time are rescaled
        (processor sharing, with the profile's measured factors)."""
        if self._contending:
            self._again = True  # a rescheduled decode batch changed a busy state: go round again
            return
        self._contending = True
        try:
            self._again = True
            while self._again:
                self._again = False
                busy = sum(1 for x in self.workers if x.busy_from is not None)
                for w in self.workers:
                    others = busy - (w.busy_from is not None)
                    p_mult, d_mult, _ = self.p.shared_host_factors(others)
                    if p_mult != w.cont_p:
                        if w.chunk_arg is not None:
                            left = (
                                max(0.0, w.chunk_left - (self.now - w.chunk_t)) * p_mult / w.cont_p
                            )
                            w.chunk_t, w.chunk_left = self.now, left
                            w.chunk_ver += 1
                            self._push(self.now + left, PREFILL_DONE, w, w.chunk_ver)
                        w.cont_p = p_mult
                    if d_mult != w.cont_d:
                        ratio, w.cont_d = d_mult / w.cont_d, d_mult
                        if w.batch:
                            self._set_factors(w, 1.0, ratio)
                        else:  # nothing decoding: no step to reschedule (nor a busy state to touch)
                            w.decode_factor *= ratio
        finally:
            self._contending = False

    def _set_factors(self, w: Worker, prefill_mult: float, decode_mult: float) -> None:
        """Multiply ``w``'s prefill and decode time factors (contention, a lease) and
        reschedule its decode batch at the new step time."""
        if w.batch and not w.decode_paused and not w.colo_stepping:
            w.advance(self.now)
        w.prefill_factor *= prefill_mult
        w.decode_factor *= decode_mult
        self._reschedule(w)
