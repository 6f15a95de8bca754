"""Pallas kernels for GPUs (Triton / Mosaic GPU lowering), registered for the `gpu`
platform; each also runs in interpret mode on a CPU (interpret.py), where the tests check
them against the XLA references.

  flash_attention   self-attention with sinks, band and segments, forward and backward
  decode_experts    a decode batch through only its chosen experts (bf16 weights)
  mxfp4_experts     the same with MXFP4 weights decoded inside the kernel
  moe_decode        both behind the `moe_decode` op
  grouped_matmul    JAX's Mosaic GPU ragged-dot kernels for the MoE (Hopper)
"""
