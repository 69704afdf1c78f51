"""The router's charge of a request to its prefill worker while the global index lookup runs
beside the dispatch (no network)."""

from __future__ import annotations

import asyncio

from bana_sglang.router.pairs import PrefillCharge
from bana_sglang.router.workers import Worker
from bana_sglang.types import Tier


def test_a_prefill_charge_is_lowered_by_the_lookup_until_it_is_released():
    """The global index lookup runs beside the dispatch: the prefill worker is charged
    the whole prompt, and the lookup's answer lowers the charge to the uncached part;
    an answer that comes after the request ended changes nothing."""
    w = Worker("http://127.0.0.1:1", Tier.PREFILL, bootstrap_port=2)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        charge = PrefillCharge(w, 1000)
        w.begin(1000)
        lookup = loop.create_future()
        lookup.add_done_callback(charge.settle)
        assert w.inflight_tokens == 1000
        lookup.set_result(992)
        await asyncio.sleep(0)
        assert w.inflight_tokens == 8 and w.inflight == 1
        charge.release()
        charge.release()  # idempotent
        assert w.inflight_tokens == 0 and w.inflight == 0
        late = PrefillCharge(w, 500)
        w.begin(500)
        late.release()
        done = loop.create_future()
        done.set_result(400)
        late.settle(done)
        assert w.inflight_tokens == 0
        failed = loop.create_future()
        failed.set_exception(RuntimeError("index down"))
        other = PrefillCharge(w, 300)
        w.begin(300)
        other.settle(failed)  # no answer: the whole prompt stays charged
        assert w.inflight_tokens == 300

    asyncio.run(run())
