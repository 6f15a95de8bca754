"""Inference: loading, KV-cache generation, the serving engine, scoring, LoRA adapters;
nothing from training/ or decode/ (the decode command's front-ends)."""
