"""The CPU serving benchmark shape (tools.bench_engine, docs/PERFORMANCE.md): gpt-oss's
architecture at about 130 M parameters with gpt-oss-20b's 32 experts, top-4: hidden 512,
4 layers, 8 query / 2 KV heads of 64, expert hidden 512, vocabulary 32,768, window 128.

    python -m gpt_oss_train.tools.bench_engine --config=configs/cpu_serve.py

A benchmark shape with random weights, not a model to train: the vocabulary is cut to
32,768 (the tokenizer's ids go up to 201,088).
"""

from gpt_oss_train.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        vocab_size=32768,
        hidden_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        num_experts=32,
        experts_per_token=4,
        intermediate_size=512,
        sliding_window=128,
    )
    c.dtype = "float32"  # this CPU has no fast bfloat16 matmul
    c.remat_policy = "none"
    c.moe_impl = "ragged"
    return c
