"""Migration between SGLang PD workers (``docs/MIGRATION.md`` has the protocols).

Every worker runs one migration agent inside its SGLang scheduler
(:mod:`.agent`, wired in by :mod:`.hooks`), answering the typed control
channel of :mod:`bana_sglang.wire.agent` (operator -> agent, agent -> agent;
:mod:`.client` is its torch-free client). The agent composes one handler per
mechanism:

- layer migration (:mod:`.layers`): the weights of a layer range are staged
  on a peer through the Mooncake transfer engine and checked by CRC32, then
  the execution can switch there (``handler`` for both sides, ``switch``,
  ``owner`` in the owner's forward, ``guest`` on the peer);
- KV-block migration (:mod:`.kv`): KV pages of running decode requests move
  to a peer that computes partial attention over them, merged exactly
  (``handler``, ``lender`` on the lender with ``segments`` and
  ``connection`` to its host, ``host`` on the host);
- live request migration (:mod:`.requests`): a running decode request stops
  at a batch boundary with its KV published to the global store, and the
  router continues it on another decode worker (``handler``).

Shared by the three: :mod:`.services` (what the handlers share with the
agent), :mod:`.records` (a migration's record, per kind), :mod:`.states`
(kinds, sides, states, pending actions), :mod:`.config` (the agent's
settings), :mod:`.errors` and :mod:`.transfer` (the transfer engine, CRC32).
``python -m bana_sglang.migrate`` is the operator's command line.
"""
