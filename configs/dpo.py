"""Direct preference optimisation (DPO) with LoRA: the adapters learn to prefer the chosen
reply of each pair over the rejected one, against the base with the adapters off.

  # minutes on a 2-core CPU, on the tiny model the quick start trains
  python -m gpt_oss_train.train --config=configs/dpo.py --workdir=runs/dpo \
      --config.checkpoint.init_from=runs/cpu_tiny

  # your pairs: TRL's conversational preference format, one JSON object per line
  #   {"prompt": [{"role": "user", "content": ...}],
  #    "chosen": [{"role": "assistant", "channel": "final", "content": ...}],
  #    "rejected": [{"role": "assistant", "channel": "final", "content": ...}]}
  ... --config.data.source=pairs:FILE.jsonl --config.data.eval_source=pairs:HELD_OUT.jsonl

`train.global_batch_size` counts rows: a pair is two (the chosen and the rejected reply).
Without LoRA (`--config.lora.rank=0`) every parameter trains and the reference is a frozen
copy of the starting parameters (twice the parameter memory). The metrics are TRL's:
`rewards/chosen` and `rewards/rejected` (beta times each reply's log-ratio to the
reference), `rewards/margins`, `rewards/accuracies` (pairs whose chosen reward is higher),
and the same with `eval_` on the held-out pairs.
"""

import os

from gpt_oss_train.config import from_file


def get_config():
    # configs/lora_sft.py's model and adapters, on the bundled preference pairs
    c = from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "lora_sft.py"))
    c.train.update(
        objective="dpo",
        steps=40,
        global_batch_size=16,  # 8 pairs
        seq_len=96,
        learning_rate=5e-3,
        warmup_steps=4,
        end_lr_ratio=0.1,
        log_every=5,
        eval_every=20,
        eval_batches=4,
        loss_chunk_size=96,
        aux_loss_coef=0.0,
    )
    c.dpo.update(beta=0.1, label_smoothing=0.0)
    c.data.update(
        source="pairs:data/sample_pairs.jsonl", eval_source="pairs:data/sample_pairs_eval.jsonl"
    )
    c.checkpoint.update(every=20)
    return c
