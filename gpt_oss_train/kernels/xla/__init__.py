"""The XLA reference of every operation: plain jax that runs on any platform. These are
the numbers the platform kernels are tested against, and what runs wherever a kernel is
not chosen, not available on this machine, or does not take the operands.

  attention        self-attention (full logits; blockwise), attention over a cache layer
  grouped_matmul   tiled loops over each group's rows, forward and backward
  experts          the experts' gated activation; decode batches over their chosen experts
  matmul           projections and the unembedding
  cross_entropy    a loss chunk's log-probabilities with a mixed-precision backward
  optimizer        optax's update
"""
