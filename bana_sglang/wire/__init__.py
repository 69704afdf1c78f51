"""The wire protocol: the bottom layer every bana_sglang process speaks.

Torch-free (ZMQ and msgspec only), so the router and the command-line tools
import it without the model stack.

- :mod:`.envelope`: the typed, versioned request/reply envelope and
  :class:`Channel` (decode and validate one channel's requests and replies).
- :mod:`.transport`: the one ZMQ request/reply transport: :class:`Server` (a
  ROUTER socket, a handler per request type, exactly one reply per request) and
  :class:`Client` (a DEALER socket, ids, deadlines, late replies skipped), with
  one exception, :class:`ChannelError`, and a message size cap.
- One module per channel, each its typed messages and its ``CHANNEL``:
  :mod:`.index` (workers and router -> the global prefix index service),
  :mod:`.agent` (operators, router, balancer and agents -> a worker's migration
  agent), :mod:`.layer_steps` (a layer migration's owner -> the guest executing
  its layers), :mod:`.kv_blocks` (a KV-block lender -> the peer hosting its pages).
"""

from bana_sglang.wire.envelope import Channel, Error, Reply, Request, encode

__all__ = ["Channel", "Error", "Reply", "Request", "encode"]
