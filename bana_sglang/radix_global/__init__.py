"""Global KV cache store (planned).

Will hold: the global radix/prefix index over page hashes (one ZMQ service
that workers and the router query), the Mooncake-Store-backed page store, and
the SGLang prefix-cache hook that loads missing pages layer by layer.
"""
