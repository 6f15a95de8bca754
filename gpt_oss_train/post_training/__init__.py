"""Post-training: what a GRPO run adds around the train step, above training/ and
inference/ (it uses both) and below the entry points.

prompts.py    where GRPO prompts come from (chat JSONL, reasoning-gym tasks)
rewards.py    reward functions: named in the config, built-ins, scoring
rollouts.py   each step's batch: the serving engine samples the live policy, the rewards
              score it, advantages are normalised within each group

The learner's side of DPO and GRPO (their losses, the table of objectives) stays on
training's floor, in training/objectives.py and training/rl_losses.py: the state builder
there makes the step of whatever objective the config names, for train.py and the tools
alike, and training imports nothing from this folder above it.
"""
