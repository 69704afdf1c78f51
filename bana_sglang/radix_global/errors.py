"""The one exception class of :mod:`bana_sglang.radix_global`.

Every failure that crosses this subpackage's boundary is a :class:`RadixGlobalError`
(or a subclass) carrying what was attempted, on what, and why. Misses are not
errors: lookups and loads return miss results instead of raising.
"""

from __future__ import annotations


class RadixGlobalError(RuntimeError):
    """A global-store operation failed. ``op``: what was attempted; ``target``: the
    key/endpoint/page it was attempted on; ``reason``: why; ``code``: a native or
    protocol error code when there is one."""

    def __init__(self, op: str, reason: str, *, target: str = "", code: int | str | None = None):
        self.op = op
        self.target = target
        self.reason = reason
        self.code = code
        where = f" {target}" if target else ""
        tag = f" [{code}]" if code is not None else ""
        super().__init__(f"{op}{where}: {reason}{tag}")


class StoreError(RadixGlobalError):
    """A Mooncake store call failed; ``code`` is Mooncake's native return code."""


class IndexUnavailable(RadixGlobalError):
    """The index service did not answer in time (it is down or overloaded)."""
