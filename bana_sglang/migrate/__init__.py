"""Migration between SGLang PD workers (``docs/MIGRATION.md`` has the protocols).

- ``messages``: the typed, versioned ZMQ control channel (operator -> agent, agent -> agent);
- ``agent``: the per-worker agent in the SGLang scheduler (``hooks`` wires it in);
- layer migration: weight staging through the Mooncake transfer engine, then the
  execution switch (``switch``, ``remote`` on the owner, ``guest`` on the peer,
  ``steps`` their channel);
- KV-block migration: pages of running decode requests on a peer that computes
  partial attention, merged exactly (``kvagent``, ``kvlend`` on the lender,
  ``kvhost`` on the host, ``kvwire`` their channel);
- ``balancer``: the pure policy from load snapshots to a migration plan;
  ``controller``: the live balancer that carries it out;
- ``python -m bana_sglang.migrate``: the operator's command line.

Not built: live request migration between decode workers.
"""
