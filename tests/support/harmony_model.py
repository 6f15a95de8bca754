"""A tiny gpt-oss (real o200k_harmony vocabulary, hidden size 64) that has memorised a few
Harmony conversations, so server tests parse what a model really generated: analysis then
final, a commentary tool call with JSON arguments, the answer after the tool's result,
and a different analysis for low and high reasoning effort.

`train(folder)` fits it with the project's optimizer and model, writes a float32 Hugging
Face folder (tokenizer included) and checks that greedy decoding of every prompt gives
exactly its target. Not a test module: conftest.py's `harmony_checkpoint` fixture calls it
once and caches the folder under the system temp dir, keyed by a hash of this recipe.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gpt_oss_train import config as config_lib
from gpt_oss_train.decode import requests
from gpt_oss_train.inference import loading
from gpt_oss_train.io import hf
from gpt_oss_train.io import tokenizer as tok_lib
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.training import loss as loss_lib
from gpt_oss_train.training import steps

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
WEATHER_RESULT = '{"temperature": 18, "sky": "sunny"}'
CAPITAL_Q = "What is the capital of France?"
CAPITAL_A = "The capital of France is Paris."
WEATHER_Q = "What is the weather in Paris?"


def _analysis(text):
    return {"role": "assistant", "channel": "analysis", "content": text}


def _final(text):
    return {"role": "assistant", "channel": "final", "content": text}


TOOL_CALL = {
    "role": "assistant",
    "channel": "commentary",
    "recipient": "functions.get_weather",
    "content_type": "<|constrain|>json",
    "content": WEATHER_ARGS,
}
WEATHER_ANALYSIS = _analysis("Need the weather tool for Paris.")

# (prompt messages, tools, reasoning effort, the assistant messages the model must write)
EXAMPLES = [
    (
        [{"role": "user", "content": CAPITAL_Q}],
        None,
        "low",
        [_analysis("Easy."), _final(CAPITAL_A)],
    ),
    (
        [{"role": "user", "content": CAPITAL_Q}],
        None,
        "high",
        [_analysis("The user asks for the capital of France. It is Paris."), _final(CAPITAL_A)],
    ),
    (
        [{"role": "user", "content": "What is 2 + 3?"}],
        None,
        "medium",
        [_analysis("Add."), _final("5")],
    ),
    (
        [{"role": "user", "content": "What color is a clear sky?"}],
        None,
        "medium",
        [_analysis("Simple."), _final("Blue")],
    ),
    (
        [{"role": "user", "content": WEATHER_Q}],
        [WEATHER_TOOL],
        "medium",
        [WEATHER_ANALYSIS, TOOL_CALL],
    ),
    (
        [
            {"role": "user", "content": WEATHER_Q},
            WEATHER_ANALYSIS,
            TOOL_CALL,
            {"role": "tool", "name": "functions.get_weather", "content": WEATHER_RESULT},
        ],
        [WEATHER_TOOL],
        "medium",
        [_final("It is 18 degrees and sunny in Paris.")],
    ),
]

ARCH_OVERRIDES = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_experts=4,
    experts_per_token=2,
    intermediate_size=64,
    sliding_window=32,
    max_position_embeddings=4096,
)
# The loss is below 1e-3 (every target token > 99.9% likely) by step ~100 on this data.
STEPS, LEARNING_RATE, SEED = 150, 1e-2, 0


def encoded_examples(tokenizer: tok_lib.Tokenizer):
    """[(prompt ids, target completion ids)], the prompt as the server renders it."""
    out = []
    for prompt, tools, effort, reply in EXAMPLES:
        ids, _ = tokenizer.render_chat_for_training(prompt + reply, effort, tools)
        head = tokenizer.render_chat(prompt, effort, tools)
        assert ids[: len(head)] == head, "the training render does not extend the prompt"
        out.append((head, ids[len(head) :]))
    return out


def recipe_hash() -> str:
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _config():
    c = config_lib.default_config()
    c.model.update(ARCH_OVERRIDES)
    c.dtype = "float32"
    c.remat_policy = "none"
    c.moe_impl = "dense"  # the fastest on a CPU at 4 experts
    c.seed = SEED
    c.train.update(
        steps=STEPS,
        learning_rate=LEARNING_RATE,
        warmup_steps=10,
        weight_decay=0.0,
        end_lr_ratio=0.1,
        grad_clip_norm=1.0,
    )
    return c


def _packed_batch(pairs):
    """All examples packed into one row (segment ids keep them apart), plus the flat indices
    of the completion positions: only they are scored, so each step computes logits for a
    few hundred positions instead of the whole row (the 201,088-way unembedding dominates)."""
    inputs, targets, positions, segments, scored = [], [], [], [], []
    for seg, (head, tail) in enumerate(pairs, start=1):
        seq = head + tail
        start = len(inputs)
        inputs += seq[:-1]
        targets += seq[1:]
        positions += list(range(len(seq) - 1))
        segments += [seg] * (len(seq) - 1)
        scored += range(start + len(head) - 1, start + len(seq) - 1)
    arr = lambda x: jnp.asarray([x], jnp.int32)
    return arr(inputs), arr(targets), arr(positions), arr(segments), jnp.asarray(scored)


def _fit(config, pairs):
    md = ModelDef(config_lib.ModelConfig.from_config(config))
    params = md.init(config.seed)
    tx, _ = steps.make_optimizer(config.train)
    inputs, targets, positions, segments, scored = _packed_batch(pairs)

    def loss_fn(p):
        hidden, _, _ = md.bind(p)(inputs, positions, segments)
        h = hidden[0, scored][None]
        logp, _ = loss_lib.token_logprobs(
            h, p["unembed"]["kernel"], targets[0, scored][None], chunk=512, dtype=jnp.float32
        )
        return -jnp.mean(logp)

    @jax.jit
    def step(p, opt):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, loss

    opt = tx.init(params)
    for _ in range(config.train.steps):
        params, opt, loss = step(params, opt)
    return md, params, float(loss)


def _greedy_check(folder: str, pairs) -> list[str]:
    """decode's generate path on the saved folder: every prompt must give its target."""
    model = loading.load_model(folder, loading.default_runtime_config(), dtype="float32")
    lines = "".join(
        json.dumps({"tokens": head, "max_new_tokens": len(tail) + 4, "stop_ids": [tail[-1]]}) + "\n"
        for head, tail in pairs
    )
    got = requests.run_generate(model, lines.encode(), loading.Options())
    return [
        f"example {i}: got {tok_lib.Tokenizer().decode(r['tokens'])!r}"
        for i, (r, (_, tail)) in enumerate(zip(got, pairs))
        if r["tokens"] != tail
    ]


def train(folder: str) -> str:
    """Fit, save to `folder` (a float32 HF folder with tokenizer), verify; returns folder."""
    pairs = encoded_examples(tok_lib.Tokenizer())
    config = _config()
    with jax.default_device(jax.devices()[0]):
        _, params, loss = _fit(config, pairs)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(folder), prefix=".train-")
    shutil.rmtree(tmp)
    params = jax.tree.map(np.asarray, params)
    hf.save_hf(tmp, config_lib.model_arch(config), params, dtype="float32")
    wrong = _greedy_check(tmp, pairs)
    if wrong:
        raise AssertionError(f"final loss {loss:.4f}; not memorised: " + "; ".join(wrong))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process (a pytest-xdist worker) finished the same fit first
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise
        shutil.rmtree(tmp)
    return folder


def cached(root: str | None = None) -> str:
    """The trained folder, trained on first use and kept under the temp dir."""
    root = root or os.path.join(tempfile.gettempdir(), "gpt_oss_train_test_cache")
    folder = os.path.join(root, f"harmony_model_{recipe_hash()}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        os.makedirs(root, exist_ok=True)
        train(folder)
    return folder
