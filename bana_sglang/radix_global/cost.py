"""When a store hit pays: loading pages against recomputing their tokens, measured.

A hit is worth loading only if loading it is faster than computing it again.
HiCache answers that with a fixed prefetch threshold; here both sides are
measured on the worker itself and the decision follows the measurements:

- :class:`LinearFit`: an exponentially forgetting least-squares line
  ``seconds = a + b * x`` (``a, b >= 0``), so a load's fixed cost (a session
  with the master, a header check) and its per-page cost are told apart;
- :class:`CostModel`: load time against pages loaded, prefill time against
  tokens computed (batches without loads), and :meth:`CostModel.decide` for a
  hit of ``pages`` pages: load when the predicted load time is below the
  predicted compute time of those tokens.

Until it has seen both (``min_samples`` of each) it loads, so the first hits
measure the store. When it has chosen to recompute for a while, every
``explore_every``-th such hit is loaded anyway, so a store that got faster is
noticed. ``policy="always"`` loads every hit (the model still measures).
Pure: no I/O, no torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

POLICIES = ("auto", "always")


class LinearFit:
    """Least squares ``y = a + b x`` over samples weighted ``decay**age``."""

    def __init__(self, decay: float = 0.95):
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.n = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.n += 1

    def coefficients(self) -> tuple[float, float]:
        """(a, b), both >= 0; with one distinct x, the line through the origin and the mean."""
        if self._w == 0:
            return 0.0, 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var <= 1e-12 * max(1.0, mx * mx):
            return 0.0, (my / mx if mx > 0 else 0.0)
        b = (self._xy / self._w - mx * my) / var
        if b < 0:  # noise: fall back to the mean per unit
            return 0.0, (my / mx if mx > 0 else 0.0)
        a = my - b * mx
        if a < 0:
            a, b = 0.0, (self._xy / self._xx if self._xx > 0 else 0.0)
        return a, b

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


@dataclass(frozen=True)
class Decision:
    load: bool
    reason: str  # "no data", "faster", "slower", "explore", "always"
    load_s: float = 0.0  # predicted
    compute_s: float = 0.0  # predicted


class CostModel:
    """Measured load and prefill costs of one worker and the load-or-recompute choice."""

    def __init__(
        self,
        page_size: int,
        *,
        policy: str = "auto",
        min_samples: int = 3,
        explore_every: int = 20,
        decay: float = 0.95,
    ):
        if policy not in POLICIES:
            raise ValueError(f"load policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.page_size = page_size
        self.policy = policy
        self.min_samples = min_samples
        self.explore_every = explore_every
        self.load = LinearFit(decay)  # seconds against pages
        self.prefill = LinearFit(decay)  # seconds against tokens
        self._skipped = 0
        self._lock = threading.Lock()

    def observe_load(self, pages: int, seconds: float) -> None:
        if pages > 0 and seconds >= 0:
            with self._lock:
                self.load.add(pages, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.prefill.add(tokens, seconds)

    def decide(self, pages: int) -> Decision:
        """Load ``pages`` hit pages, or compute their tokens again?"""
        with self._lock:
            if self.policy == "always":
                return Decision(True, "always")
            if self.load.n < self.min_samples or self.prefill.n < self.min_samples:
                return Decision(True, "no data")
            load_s = self.load.predict(pages)
            # the marginal cost of the tokens: what the prefill line adds per token
            _, per_token = self.prefill.coefficients()
            compute_s = per_token * pages * self.page_size
            if load_s < compute_s:
                self._skipped = 0
                return Decision(True, "faster", load_s, compute_s)
            self._skipped += 1
            if self.explore_every and self._skipped % self.explore_every == 0:
                return Decision(True, "explore", load_s, compute_s)
            return Decision(False, "slower", load_s, compute_s)
