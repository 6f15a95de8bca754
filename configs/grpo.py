"""GRPO: completions sampled from the live policy, rewarded, and reinforced by group.

  # minutes on a 2-core CPU, on the tiny model the quick start trains: from the bundled
  # arithmetic prompts it learns to write more whitespace (the `whitespace` reward)
  python -m gpt_oss_train.train --config=configs/grpo.py --workdir=runs/grpo \
      --config.checkpoint.init_from=runs/cpu_tiny

  # LoRA: the engine samples the base with the trained adapters, and the reference
  # policy (rl.kl_coef > 0) is the base with them off, at no memory cost
  ... --config.lora.rank=8 --config.lora.alpha=16 --config.lora.targets=q,k,v,o,gate_up,down

  # a real task: your prompts with an "answer" field, scored by math-verify
  ... --config.data.source=chat:PROMPTS.jsonl --config.rl.rewards=exact_answer,format \
      --config.rl.reward_weights=1.0,0.2
  # or procedural problems with their own verifier, generated offline
  ... --config.data.source=rl:reasoning_gym:basic_arithmetic

Each step samples rl.group_size completions of global_batch_size / group_size prompts
with the serving engine on the trained weights, scores them, and takes rl.num_iterations
optimizer updates on them (gpt_oss_train/post_training/: group-normalised advantages,
the clipped ratio to the sampling policy, the k3 KL to the reference when rl.kl_coef > 0;
log-probs at rl.temperature). Full fine-tuning here: on the 2-layer model LoRA adapters
barely move the policy (docs/PERFORMANCE.md, "Post-training on the CPU").
"""

import os

from gpt_oss_train.config import from_file


def get_config():
    # configs/sft_chat.py's model and data settings
    c = from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft_chat.py"))
    c.train.update(
        objective="grpo",
        steps=30,
        global_batch_size=32,  # 8 prompts x 4 completions
        seq_len=128,
        learning_rate=1e-3,
        warmup_steps=2,
        end_lr_ratio=0.5,
        log_every=1,
        eval_every=0,
        loss_chunk_size=128,
        aux_loss_coef=0.0,
    )
    c.rl.update(
        group_size=4,
        max_prompt_tokens=96,
        max_new_tokens=8,
        temperature=1.0,
        rewards="whitespace",
        reasoning_effort="low",
    )
    c.data.update(source="chat:data/sample_prompts.jsonl", eval_source="")
    c.checkpoint.update(every=10)
    return c
