"""``python -m bana_sglang.balancer``: see :mod:`bana_sglang.balancer.server`."""

from bana_sglang.balancer.server import main

raise SystemExit(main())
