"""Our GRPO against TRL's GRPOTrainer: the same model, prompts, reward and settings.

  python -m gpt_oss_train.tools.bench_grpo_vs_trl --init_from=runs/cpu_tiny \
      --workdir=runs/grpo_vs_trl --plot=docs/grpo_vs_trl.png

Needs the `bench` extra (trl, matplotlib). In one invocation, back to back:
  1. exports --init_from to a float32 Hugging Face folder, WORKDIR/hf (with tokenizer.json
     and the Harmony chat template);
  2. runs ours: `python -m gpt_oss_train.train --config=configs/grpo.py` in a subprocess
     (WORKDIR/ours), the shared settings passed as --config.* overrides, and reads its
     per-step metrics from metrics.jsonl;
  3. runs TRL's GRPOTrainer in this process on WORKDIR/hf (GptOssForCausalLM, float32,
     CPU), every setting it shares with ours read from the same config: the same prompts
     in the same order each step, our reward functions scoring the completion's ids as our
     rollouts do, group size, lengths, temperature, AdamW with our schedule, clipping,
     loss averaging, no KL;
  4. writes WORKDIR/results.json and the two reward curves as a PNG (--plot), and prints
     seconds per step, split into the rollout and the learning.

Seconds are wall clock. A step is the time between the ends of two steps (step 1, which
compiles, is left out of the means). The rollout is our `rollout_s` (the engine's
generation; scoring the completions, milliseconds, falls in our learning) and TRL's
`_generate_and_score_completions` (generation, decoding, reward, advantages); the
learning is the rest of the step.

What still differs: our rows are padded to train.seq_len, TRL's to the batch's longest;
TRL also ends a completion at <|endoftext|> (its generation config's end ids), ours only
at <|return|> and <|call|>; the two samplers draw from different random streams; and on
a CPU TRL scores the log-probabilities of every position (its chunked LM-head path, with
entropies), not only the completion's.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time

from absl import app, flags

from gpt_oss_train import errors
from gpt_oss_train.config import from_file
from gpt_oss_train.io.tokenizer import Tokenizer
from gpt_oss_train.post_training import prompts as prompts_lib
from gpt_oss_train.post_training import rewards as rewards_lib
from gpt_oss_train.post_training import rollouts
from gpt_oss_train.training import steps as steps_lib

# The flags and their defaults; OPTS holds the run's values (main fills it from the flags,
# defined only when this runs as a program: `workdir` and `config` are also train.py's).
DEFAULTS = {
    "init_from": ("runs/cpu_tiny", "Our checkpoint (a workdir)."),
    "workdir": (
        "runs/grpo_vs_trl",
        "Where the export and the runs go (hf/, ours/, trl/ replaced).",
    ),
    "plot": ("docs/grpo_vs_trl.png", "The reward curves' PNG ('' none)."),
    "config": ("configs/grpo.py", "Our GRPO config (both sides read it)."),
    "steps": (30, "Optimizer steps (one rollout batch each)."),
    "prompts_per_step": (8, "Prompts per rollout batch."),
    "group_size": (4, "Completions per prompt (TRL num_generations)."),
    "max_new_tokens": (8, "TRL max_completion_length."),
    "learning_rate": (1e-3, "Peak learning rate."),
    "temperature": (1.0, "Sampling temperature."),
    "sides": (
        ["ours", "trl"],
        "Which to run; one left out keeps its WORKDIR/results.json numbers.",
    ),
}
OPTS = {name: default for name, (default, _) in DEFAULTS.items()}


def _define_flags():
    define = {
        str: flags.DEFINE_string,
        int: flags.DEFINE_integer,
        float: flags.DEFINE_float,
        list: flags.DEFINE_list,
    }
    for name, (default, help_text) in DEFAULTS.items():
        define[type(default)](name, default, help_text)


# Our rl.averaging -> TRL's loss_type of the same sum and normalizer (rl_losses.grpo_sums).
LOSS_TYPES = {"sequence": "grpo", "token": "bnpo", "dr_grpo": "dr_grpo"}
SIDES = ("ours", "trl")
LABELS = {"ours": "gpt_oss_train (JAX)", "trl": "TRL GRPOTrainer (torch)"}


# ----------------------------------------------------------------------------- settings


def shared_settings() -> dict:
    """The settings both sides take from the flags, as dotted config keys."""
    steps = OPTS["steps"]
    return {
        "train.steps": steps,
        "train.global_batch_size": OPTS["prompts_per_step"] * OPTS["group_size"],
        "train.learning_rate": OPTS["learning_rate"],
        "rl.group_size": OPTS["group_size"],
        "rl.max_new_tokens": OPTS["max_new_tokens"],
        "rl.temperature": OPTS["temperature"],
        # No save inside the timed steps (TRL saves nothing either); the end's is after them.
        "checkpoint.every": steps,
    }


def load_config(settings: dict):
    """Our config file with the shared settings applied, as the trainer's overrides apply."""
    c = from_file(OPTS["config"])
    for key, value in settings.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


# ----------------------------------------------------------------------------- the reward


class OurReward:
    """config.rl.rewards as one TRL reward function. TRL passes each completion's ids
    (the ids after the prompt, up to and with the end of turn); they are parsed into the
    record our rollouts score (rewards.completion_record) and scored with the prompt's
    other fields, as rollouts.Rollouts does. Keeps each call's mean: one call a step."""

    def __init__(self, spec: str, weights: str, columns: list[str]):
        self.lib, self.tokenizer, self.columns = rewards_lib, Tokenizer(), columns
        self.rewards = rewards_lib.load_rewards(spec, weights)
        self.__name__ = "+".join(name for name, _, _ in self.rewards)  # TRL's metric name
        self.means: list[float] = []

    def __call__(self, prompts, completions, completion_ids, **kwargs) -> list[float]:
        totals = []
        for i, (prompt, ids) in enumerate(zip(prompts, completion_ids)):
            record = self.lib.completion_record(ids, self.tokenizer)
            extra = {k: kwargs[k][i] for k in self.columns}  # not TRL's own (trainer_state...)
            totals.append(self.lib.score(self.rewards, prompt, record, extra)[0])
        self.means.append(sum(totals) / len(totals))
        return totals


def prompt_rows(c, steps: int) -> list[dict]:
    """The prompts our rollouts draw, in their order (the same shuffled pipeline), as TRL
    dataset rows {"prompt": messages, **extra}: TRL reads them in order (no shuffle), so
    step s of both sides samples the same prompts."""
    source = prompts_lib.make_prompt_source(c.data.source, seed=c.seed)
    pipeline = rollouts.prompt_pipeline(
        source, c.train.global_batch_size // c.rl.group_size, c.seed
    )
    rows = []
    for _ in range(steps):
        for rec in next(pipeline):
            if rec.reasoning_effort not in (None, c.rl.reasoning_effort):
                raise ValueError("a prompt names its own reasoning_effort; TRL renders one for all")
            rows.append({"prompt": rec.messages, **rec.extra})
    return rows


def lr_factors(c) -> list[float]:
    """Our schedule (training/steps.make_optimizer) as the factors of TRL's LambdaLR, one
    per optimizer update: TRL's own warmup starts from 0, ours from lr/warmup_steps."""
    _, schedule = steps_lib.make_optimizer(c.train)
    return [float(schedule(k)) / c.train.learning_rate for k in range(c.train.steps)]


# ----------------------------------------------------------------------------- the two runs


def export(init_from: str, hf_dir: str) -> None:
    _replace(hf_dir)
    cmd = [sys.executable, "-m", "gpt_oss_train.tools.convert_checkpoint"]
    cmd += [f"--orbax_dir={init_from}", f"--hf_out={hf_dir}", "--dtype=float32"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_ours(settings: dict, init_from: str, workdir: str) -> dict:
    """Our trainer in a subprocess (its own JAX process, as a user runs it)."""
    _replace(workdir)
    cmd = [sys.executable, "-m", "gpt_oss_train.train", f"--config={OPTS['config']}"]
    cmd += [f"--workdir={workdir}", f"--config.checkpoint.init_from={init_from}"]
    cmd += [f"--config.{k}={v}" for k, v in settings.items()]
    print(" ".join(cmd[1:]), flush=True)
    load, t0 = os.getloadavg()[0], time.perf_counter()
    with open(workdir + ".log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    out = {k: [] for k in ("reward", "step_s", "rollout_s", "learn_s", "learning_rate")}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    for m in sorted((m for m in lines if "reward" in m), key=lambda m: m["step"]):
        step_s = m.get("perf/step_time_seconds")  # absent at step 1 (no previous step's end)
        out["reward"].append(m["reward"])
        out["step_s"].append(step_s)
        out["rollout_s"].append(m["rollout_s"])
        out["learn_s"].append(None if step_s is None else step_s - m["rollout_s"])
        out["learning_rate"].append(m["learning_rate"])
    return {**out, "wall_s": wall, "loadavg_before": load, "loadavg_after": os.getloadavg()[0]}


def run_trl(c, hf_dir: str, workdir: str) -> dict:
    """TRL's GRPOTrainer with our config's settings (what cannot match: the docstring)."""
    # lazy: optional dependency (the `bench` extra; torch and transformers take seconds)
    import datasets
    import torch
    import transformers
    import trl

    _replace(workdir)
    load, t0 = os.getloadavg()[0], time.perf_counter()
    rl = c.rl
    rows = prompt_rows(c, c.train.steps)
    reward = OurReward(rl.rewards, rl.reward_weights, [k for k in rows[0] if k != "prompt"])
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    chat_kwargs = {"reasoning_effort": rl.reasoning_effort}  # TRL's template default: medium
    same = prompt_ids_match(rows, tokenizer, chat_kwargs, rl.reasoning_effort)
    optimizers = our_optimizer(c, model)
    args = trl_config(c, workdir, chat_kwargs)
    timings = {"step_s": [], "rollout_s": [], "generate_s": []}
    trainer_cls, clock = _timed_trainer(trl.GRPOTrainer, transformers.TrainerCallback, timings)
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        optimizers=optimizers,
        callbacks=[clock],
    )
    trainer.train()
    wall = time.perf_counter() - t0
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    return {
        "reward": reward.means,
        **timings,
        "learn_s": [s - r for s, r in zip(timings["step_s"], timings["rollout_s"])],
        "learning_rate": lrs,
        "wall_s": wall,
        "loadavg_before": load,
        "loadavg_after": os.getloadavg()[0],
        "prompt_ids_equal": same,
        "torch_threads": torch.get_num_threads(),
        "versions": {m.__name__: m.__version__ for m in (trl, transformers, torch)},
    }


def our_optimizer(c, model):
    """(torch AdamW, its LambdaLR) as ours: TRL takes a ready optimizer and scheduler."""
    import torch  # lazy: optional dependency, as in run_trl

    t = c.train
    opt = torch.optim.AdamW(
        model.parameters(),
        t.learning_rate,
        betas=(t.b1, t.b2),
        eps=t.eps,
        weight_decay=t.weight_decay,
    )
    factors = lr_factors(c)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: factors[min(k, len(factors) - 1)])
    return opt, sched


def trl_config(c, workdir: str, chat_kwargs: dict):
    """TRL's GRPOConfig with every setting it shares with ours read from our config."""
    import trl  # lazy: optional dependency, as in run_trl

    t, rl = c.train, c.rl
    return trl.GRPOConfig(
        output_dir=workdir,
        max_steps=t.steps,
        per_device_train_batch_size=t.global_batch_size,  # one update per rollout batch
        gradient_accumulation_steps=1,
        num_generations=rl.group_size,
        max_completion_length=rl.max_new_tokens,
        temperature=rl.temperature,
        top_p=rl.top_p,
        beta=rl.kl_coef,
        num_iterations=rl.num_iterations,
        epsilon=rl.epsilon_low,
        epsilon_high=rl.epsilon_high,
        loss_type=LOSS_TYPES[rl.averaging],
        scale_rewards="group" if rl.scale_rewards else "none",
        max_grad_norm=t.grad_clip_norm,
        router_aux_loss_coef=t.aux_loss_coef,
        chat_template_kwargs=chat_kwargs,
        shuffle_dataset=False,  # rows are already in our pipeline's order
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        seed=c.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def prompt_ids_match(rows, tokenizer, chat_kwargs: dict, effort: str) -> str:
    """'k/n': how many distinct prompts the HF tokenizer's chat template renders to the ids
    our rollouts feed the engine (Tokenizer.render_chat)."""
    ours, seen, same = Tokenizer(), {}, 0
    for row in rows:
        seen[json.dumps(row["prompt"])] = row["prompt"]
    for messages in seen.values():
        hf = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, **chat_kwargs
        )["input_ids"]
        same += list(hf) == ours.render_chat(messages, effort)
    return f"{same}/{len(seen)}"


def _timed_trainer(trainer_cls, callback_cls, timings: dict):
    """The trainer with its steps and rollouts timed, and the callback that times steps: a
    step is the time between two steps' ends (the first from its beginning). TRL has no
    hook around the rollout, so the trainer wraps two of its private methods (trl 1.16's
    names): `_generate` (generation and decoding alone) and
    `_generate_and_score_completions` (with reward and advantages: the rollout)."""

    def timed(method, key):
        def wrapper(self, *args):
            t0 = time.perf_counter()
            out = getattr(trainer_cls, method)(self, *args)
            timings[key].append(time.perf_counter() - t0)
            return out

        return wrapper

    methods = {
        "_generate": timed("_generate", "generate_s"),
        "_generate_and_score_completions": timed("_generate_and_score_completions", "rollout_s"),
    }
    trainer = type("TimedGRPOTrainer", (trainer_cls,), methods)
    last = []

    class StepClock(callback_cls):
        def on_step_begin(self, args, state, control, **_):
            if not last:
                last.append(time.perf_counter())

        def on_step_end(self, args, state, control, **_):
            now = time.perf_counter()
            timings["step_s"].append(now - last[-1])
            last.append(now)

    return trainer, StepClock()


def _replace(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


# ----------------------------------------------------------------------------- results


def summary(side: dict, last: int = 10) -> dict:
    """Means over steps 2.. (step 1 compiles) and the reward over the last `last` steps."""

    def mean(xs):
        xs = [x for x in xs[1:] if x is not None]
        return sum(xs) / len(xs) if xs else math.nan

    tail = side["reward"][-last:]
    return {
        "step_s": mean(side["step_s"]),
        "rollout_s": mean(side["rollout_s"]),
        "learn_s": mean(side["learn_s"]),
        "reward_last": sum(tail) / len(tail),
        "reward_first": side["reward"][0],
    }


def table(results: dict) -> str:
    s = {k: summary(results[k]) for k in SIDES}
    ratio = lambda key: s["trl"][key] / s["ours"][key]
    n = len(results["ours"]["reward"])
    lines = [
        f"{'':14}{'ours':>10}{'TRL':>10}{'TRL/ours':>10}",
        *(
            f"{label:14}{s['ours'][k]:>10.2f}{s['trl'][k]:>10.2f}{ratio(k):>10.2f}"
            for label, k in (
                ("s/step", "step_s"),
                ("rollout s", "rollout_s"),
                ("learning s", "learn_s"),
            )
        ),
        f"{'reward, last 10':14}{s['ours']['reward_last']:>10.3f}{s['trl']['reward_last']:>10.3f}",
        f"(means over steps 2-{n}; wall for the run: ours {results['ours']['wall_s']:.0f} s, "
        f"TRL {results['trl']['wall_s']:.0f} s)",
    ]
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib  # lazy: optional dependency (the `bench` extra; ~0.3 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after the backend is chosen

    s = results["settings"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for side in SIDES:
        r = results[side]["reward"]
        ax.plot(range(1, len(r) + 1), r, marker="o", markersize=3, label=LABELS[side])
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (whitespace share)")
    ax.set_title(
        f"GRPO on the quick start's model: {s['prompts_per_step']} prompts x "
        f"{s['group_size']}, {s['max_new_tokens']} new tokens, lr {s['learning_rate']:g}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine() -> dict:
    name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
    changed = git("status", "--porcelain", "--untracked-files=no")  # tracked files edited
    return {
        "cpu": name,
        "cores": os.cpu_count(),
        "commit": git("rev-parse", "--short", "HEAD") + ("+changes" if changed else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def main(argv):
    OPTS.update({name: flags.FLAGS[name].value for name in DEFAULTS})
    del argv
    wd = OPTS["workdir"]
    os.makedirs(wd, exist_ok=True)
    results_path = os.path.join(wd, "results.json")
    previous = {}
    if set(OPTS["sides"]) != set(SIDES) and os.path.exists(results_path):
        with open(results_path) as f:
            previous = json.load(f)
    settings = shared_settings()
    c = load_config(settings)
    hf_dir = os.path.join(wd, "hf")
    results = {
        "machine": machine(),
        "settings": {
            "prompts_per_step": OPTS["prompts_per_step"],
            "group_size": OPTS["group_size"],
            "max_new_tokens": OPTS["max_new_tokens"],
            "learning_rate": OPTS["learning_rate"],
            "steps": OPTS["steps"],
            "temperature": OPTS["temperature"],
            "seq_len": c.train.seq_len,
            "config": OPTS["config"],
            "init_from": OPTS["init_from"],
        },
    }
    for side in SIDES:
        if side not in OPTS["sides"]:
            if side in previous:
                results[side] = previous[side]
            continue
        if side == "ours":
            results[side] = run_ours(settings, OPTS["init_from"], os.path.join(wd, "ours"))
        else:
            export(OPTS["init_from"], hf_dir)
            results[side] = run_trl(c, hf_dir, os.path.join(wd, "trl"))
        print(f"{side}: {results[side]['wall_s']:.0f} s", flush=True)
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)
    if not all(side in results for side in SIDES):
        print(f"results: {results_path} (one side only: no table, no plot)")
        return
    if OPTS["plot"]:
        plot(results, OPTS["plot"])
    print(table(results))
    print(f"{results['machine']}\nresults: {results_path}")


if __name__ == "__main__":
    _define_flags()
    app.run(main, flags_parser=errors.parse_flags)
