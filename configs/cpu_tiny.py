"""A tiny GPT-OSS trained on this machine's Python standard library, in a few minutes on
a 2-core CPU. The real architecture and tokenizer, shrunk: 2 layers, 4 experts."""

from gpt_oss_train.config import default_config


def get_config():
    c = default_config()
    c.model.update(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_experts=4,
        experts_per_token=2,
        intermediate_size=64,
        sliding_window=32,
    )
    # bfloat16 on CPUs with AMX or AVX512-BF16 matmul units, float32 on the others
    # (where bfloat16 is converted around every product and runs slower).
    c.dtype = "auto"
    c.remat_policy = "none"  # memory is plentiful at this size; skip the recompute
    c.moe_impl = "ragged"
    # 512 tokens a step: the 201,088-way softmax dominates the cost at this width.
    c.train.update(
        steps=50,
        global_batch_size=8,
        seq_len=64,
        learning_rate=3e-3,
        warmup_steps=5,
        log_every=10,
        loss_chunk_size=32,
        eval_every=25,
        eval_batches=2,
    )
    c.checkpoint.update(every=25, keep=2)
    return c
