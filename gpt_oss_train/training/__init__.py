"""Training: optimizer step, loss, data, metrics (checkpoints: gpt_oss_train/checkpoints)."""
