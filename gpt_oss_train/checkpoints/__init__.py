"""Checkpoints below training and inference: Orbax trees, integrity, LoRA metadata."""
