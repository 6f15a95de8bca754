"""Training: optimizer step, loss, data, checkpoints, metrics."""
