"""The agent's state vocabulary against the wire's, and its records' encoding."""

from __future__ import annotations

import msgspec

from bana_sglang.migrate import states
from bana_sglang.migrate.records import KVMigration, LayerMigration, RequestMigration
from bana_sglang.migrate.states import Kind, Side, State
from bana_sglang.wire import agent as m


def test_the_wire_state_tuples_are_the_enum_values():
    assert m.SOURCE_STATES == tuple(s.value for s in states.SOURCE_STATES)
    assert m.GUEST_STATES == tuple(s.value for s in states.GUEST_STATES)
    assert m.TERMINAL == tuple(s.value for s in states.TERMINAL)
    assert set(State) == set(states.SOURCE_STATES) | set(states.GUEST_STATES)


def test_a_record_encodes_as_its_plain_strings():
    kinds = ((LayerMigration, "layers"), (KVMigration, "kv"), (RequestMigration, "request"))
    for cls, kind in kinds:
        mig = cls(migration="x", side=Side.SOURCE, peer="p", state=State.ACCEPTED)
        mig.finish(State.REMOTE)
        assert mig.kind == kind and isinstance(mig.kind, Kind)
        info = mig.info()
        plain = msgspec.structs.replace(info, side="source", state="remote", kind=kind)
        assert type(plain.state) is str and m.encode(info) == m.encode(plain)
        done = m.Done(id=1, migration="x", state="remote", bytes=0, seconds=round(mig.seconds, 4))
        assert m.encode(mig.reply(1)) == m.encode(done)
