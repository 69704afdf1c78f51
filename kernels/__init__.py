"""Attention kernels: the math, free of SGLang, each with a torch reference.

- :mod:`kernels.cpu_attention`: attention over a paged (slot-indexed) KV pool
  whose extend cost follows the new tokens (``q_len x kv_len``, causal offset,
  GQA without KV copies), batched decode, optional log-sum-exp output, and the
  dense float64 reference. Served to SGLang by :mod:`bana_sglang.attention`
  (``--attention-backend bana_cpu``, the CPU default).
- :mod:`kernels.merge`: exact merge of partial attention states (output +
  log-sum-exp) over disjoint KV partitions, for KV-block migration; handles
  empty partitions and extreme logits. Torch reference everywhere, a Triton
  kernel for two partitions on CUDA (``tests/test_merge_cuda.py``, marked
  ``gpu``).

Planned: KV page gather/scatter on CUDA (the CPU path gathers with torch
indexing).

Note: the top-level name ``kernels`` collides with Hugging Face's ``kernels``
package (an SGLang dependency); code that must work from any working directory
imports these modules through :mod:`bana_sglang.attention._kernels`.
"""
