"""A GRPO step compiled for a TPU slice: the learner's train step and the rollout engine's
decode and prefill on the same mesh and weights. A GRPO run holds two phases' memory in
turn, so neither program's verdict alone says whether the run fits: what stays resident
across them (the engine's KV cache while the learner runs, the optimizer state while the
engine samples) is added here, and a rollout's time is read from the step model."""

from __future__ import annotations

import time

from gpt_oss_train.aot import compiled_step, serving, train_step
from gpt_oss_train.model import lora
from gpt_oss_train.post_training import rollouts


def compile_program(config, devices, dump_dir: str | None) -> dict:
    """The learner's train step and the rollout engine's decode and prefill on the same
    mesh and weights (LoRA: the frozen base with the trained adapters), and the memory of
    the two phases of a GRPO step."""
    if config.train.objective != "grpo":
        raise SystemExit("--program=grpo: the config's train.objective must be 'grpo'")
    t0 = time.perf_counter()
    setup, lowered = train_step.lower(config, devices)
    lower_s = time.perf_counter() - t0
    learner = train_step.compile_step(config, devices, dump_dir, (setup, lowered))
    learner["lower_s"] += lower_s
    state = setup.abstract_state
    policy = state["params"]
    if setup.frozen is not None:
        policy = lora.merge(setup.frozen.abstract, policy)
    opts = rollouts.engine_options(config)
    shape = serving.Shape(opts.max_slots, opts.max_context, opts.prefill_chunk)
    out = {"learner": learner}
    for program in serving.ENGINE_PROGRAMS:
        t0 = time.perf_counter()
        cache, lowered = serving.lower(
            setup.model_def, setup.mesh, setup.rules, policy, program, shape
        )
        info = serving.figures(
            setup.model_def, setup.mesh, setup.rules, policy, cache, program, shape, devices
        )
        info["weights"] = setup.frozen.format if setup.frozen is not None else "trained"
        info["lower_s"] = time.perf_counter() - t0
        out[program] = compiled_step.compile_lowered(
            info, lowered, setup.mesh, setup.rules, dump_dir
        )
    # Resident beside the engine's step: the optimizer state and a full fine-tuning run's
    # reference copy (the policy's own weights are its arguments).
    beside = compiled_step.bytes_per_device(state["opt_state"])
    if setup.reference is not None:
        beside += compiled_step.bytes_per_device(setup.reference.abstract)
    out["phases"] = phases(out, beside)
    out["rollout_estimate"] = rollout_estimate(out, config)
    return out


def phases(r: dict, beside_engine: int) -> dict:
    """Bytes per device of a GRPO step's two phases: the learner's step with the engine's
    KV cache kept, and each engine program with the optimizer state (`beside_engine`)."""
    learner, decode, prefill = r["learner"], r["decode"], r["prefill"]
    if any(p["error"] for p in (learner, decode, prefill)):
        return {}
    cache = decode["kv_cache_bytes_per_device"]
    return {
        "learning": learner["total_bytes"] + cache,
        "rollout": max(decode["total_bytes"], prefill["total_bytes"]) + beside_engine,
        "kv_cache": cache,
        "beside_engine": beside_engine,
    }


def rollout_estimate(r: dict, config) -> dict:
    """A rollout's seconds from the step model: every row's prompt prefilled one chunk a
    call (the engine prefills one slot at a time), then max_new_tokens decode steps of
    the whole batch at the longest context (an upper bound: contexts grow from the
    prompt's end)."""
    rl = config.rl
    step = lambda p: (r[p].get("estimate") or {}).get("step_s")
    prefill_s, decode_s = step("prefill"), step("decode")
    if prefill_s is None or decode_s is None:
        return {}
    chunks = -(-rl.max_prompt_tokens // r["prefill"]["shape"]["chunk"])
    rows = config.train.global_batch_size
    out = {"prefill_s": rows * chunks * prefill_s, "decode_s": rl.max_new_tokens * decode_s}
    out["rollout_s"] = out["prefill_s"] + out["decode_s"]
    learner_s = (r["learner"].get("estimate") or {}).get("step_s")
    if learner_s:
        out["learner_s"] = learner_s
        out["grpo_step_s"] = out["rollout_s"] + learner_s
    return out
