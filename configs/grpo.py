"""GRPO: completions sampled from the live policy, rewarded, and reinforced by group.

  # minutes on a 2-core CPU, on the tiny model the quick start trains: from the bundled
  # arithmetic prompts it learns to write more whitespace (the `whitespace` reward)
  python -m gpt_oss_train.train --config=configs/grpo.py --workdir=runs/grpo \
      --config.checkpoint.init_from=runs/cpu_tiny

  # a real task: your prompts with an "answer" field, scored by math-verify
  ... --config.data.source=chat:PROMPTS.jsonl --config.rl.rewards=exact_answer,format \
      --config.rl.reward_weights=1.0,0.2
  # or procedural problems with their own verifier, generated offline
  ... --config.data.source=rl:reasoning_gym:basic_arithmetic

Each step samples rl.group_size completions of global_batch_size / group_size prompts
with the serving engine on the trained weights, scores them, and takes rl.num_iterations
optimizer updates on them (training/rl_losses.py: group-normalised advantages, the
clipped ratio to the sampling policy, the k3 KL to the base when rl.kl_coef > 0; log-probs
at rl.temperature). LoRA here: the reference policy is the base, adapters off.
"""

import os

from gpt_oss_train.config import from_file


def get_config():
    # configs/lora_sft.py's model and adapters
    c = from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "lora_sft.py"))
    c.train.update(
        objective="grpo",
        steps=30,
        global_batch_size=16,  # 4 prompts x 4 completions
        seq_len=128,
        learning_rate=2e-2,
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
        max_new_tokens=32,
        temperature=1.0,
        rewards="whitespace",
        reasoning_effort="low",
    )
    c.data.update(source="chat:data/sample_prompts.jsonl", eval_source="")
    c.checkpoint.update(every=10)
    return c
