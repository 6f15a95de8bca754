"""The CPU benchmark shape of docs/PERFORMANCE.md: gpt-oss's architecture at 517 M
parameters, with gpt-oss-20b's 32 experts, top-4: hidden 768, 8 layers, 12 query / 4 KV
heads of 64, expert hidden 768, vocabulary 32,768, window 128, batch 4 x 512.

    python -m gpt_oss_train.tools.bench_model --mode=train --config=configs/cpu_bench.py \
        --compare_hf

It is a benchmark shape, not a model to train: the vocabulary is cut to 32,768 (the
tokenizer's ids go up to 201,088), so use it with tools.bench_model's random batches.
"""

from gpt_oss_train.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        vocab_size=32768,
        hidden_size=768,
        num_layers=8,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        num_experts=32,
        experts_per_token=4,
        intermediate_size=768,
        sliding_window=128,
    )
    c.dtype = "auto"
    c.moe_impl = "ragged"
    # keep the expert matmuls' outputs for the backward (0.1 GB more here), recompute the rest
    c.remat_policy = "save_moe"
    c.train.update(global_batch_size=4, seq_len=512, loss_chunk_size=512)
    return c
