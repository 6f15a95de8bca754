"""Inference: KV-cache generation, chat, benchmarks."""
