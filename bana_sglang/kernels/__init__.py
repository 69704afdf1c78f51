"""Attention kernels: the math, free of SGLang, each with a torch reference.

- :mod:`bana_sglang.kernels.cpu_attention`: attention over a paged (slot-indexed) KV pool
  whose extend cost follows the new tokens (``q_len x kv_len``, causal offset,
  GQA without KV copies), batched decode, optional log-sum-exp output, and the
  dense float64 reference. Served to SGLang by :mod:`bana_sglang.attention`
  (``--attention-backend bana_cpu``, the CPU default).
- :mod:`bana_sglang.kernels.merge`: exact merge of partial attention states (output +
  log-sum-exp) over disjoint KV partitions, for KV-block migration; handles
  empty partitions and extreme logits. Torch reference everywhere, a Triton
  kernel for two partitions on CUDA (``tests/unit/attention/test_merge_cuda.py``, marked
  ``gpu``).
"""
