"""TPU implementations, registered for the `tpu` platform.

splash_attention   JAX's Pallas splash attention, which takes the sinks itself
ragged_dot         `jax.lax.ragged_dot`, which TPUs lower natively, for the MoE
megablox           JAX's Pallas grouped matmul, its weight gradient group by group
glu                the experts' gated activation, its backward one Pallas pass
mxfp4_experts      a decode batch through its chosen MXFP4 experts, decoded in VMEM
"""
