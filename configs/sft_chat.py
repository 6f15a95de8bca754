"""Supervised fine-tuning on Harmony chat data: loss on assistant tokens only.

  python -m gpt_oss_train.train --config=configs/sft_chat.py --workdir=/tmp/sft \
      --config.checkpoint.init_from=/path/to/gpt-oss-20b-orbax \
      --config.data.source=chat:/path/to/chats.jsonl

Each data line is {"messages": [{"role": "user", "content": ...}, {"role": "assistant",
"channel": "final", "content": ...}, ...]}. With no init_from it fine-tunes a random tiny
model on the bundled sample, which is only useful to check the plumbing.
"""

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
    c.dtype = "float32"
    c.remat_policy = "none"
    c.train.update(
        steps=20,
        global_batch_size=4,
        seq_len=256,
        learning_rate=1e-4,
        warmup_steps=2,
        end_lr_ratio=0.0,
        weight_decay=0.0,
        log_every=5,
        loss_chunk_size=256,
        aux_loss_coef=0.0,
    )
    c.checkpoint.update(every=10, keep=2)
    c.data.update(source="chat:data/sample_chat.jsonl")
    return c
