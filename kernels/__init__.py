"""Attention kernels (planned).

Will hold: the attention-state merge (partial outputs + log-sum-exp) used by
KV-block migration, KV page gather/scatter, and a CPU attention path whose
extend cost follows the new tokens; each with a torch reference that runs on
CPU and a Triton/FlashInfer path for CUDA.
"""
