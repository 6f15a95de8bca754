"""What a grammar costs in the serving engine (inference/constraints.py), on random weights
of the real vocabulary:

    python -m gpt_oss_train.tools.bench_constraints --config=configs/cpu_serve.py \\
        --config.model.vocab_size=201088

  mask     the host's time to fill one request's mask row (201,088 bits) at each token of a
           JSON answer to a schema of nested objects, arrays, enums and numbers: median and
           max over the tokens (each the median of --mask_repeats fills)
  engine   --max_slots requests decoding --max_tokens greedy tokens together, of which 0,
           half or all follow a grammar (a JSON string that never closes, so every step is
           constrained): the time per decode step of each mix, in alternating rounds
           (--rounds), and the free requests' own tokens, checked unchanged

Prints one JSON line per measurement.
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import numpy as np
from absl import app, flags, logging

from gpt_oss_train import errors, runtime, sharding
from gpt_oss_train.inference import constraints, loading
from gpt_oss_train.inference.engine import Engine, RequestParams
from gpt_oss_train.io import tokenizer as tok_lib

_CONFIG = errors.define_config_flag("config", "configs/cpu_serve.py", "Model config.")
_SLOTS = flags.DEFINE_integer("max_slots", 8, "Engine slots (all decode together).")
_TOKENS = flags.DEFINE_integer("max_tokens", 48, "Tokens each request generates.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Alternating rounds of the three mixes.")
_MASK_REPEATS = flags.DEFINE_integer("mask_repeats", 200, "Fills timed at each token.")

# an answer that stays inside one JSON string: the walk is never done within max_tokens
LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        "member": {"type": "boolean"},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "floors": {"type": "array"}},
            "required": ["city"],
        },
    },
    "required": ["name", "member", "home"],
}
ANSWER = (
    '{"name":"Ada Lovelace","age":36,"colours":["red","blue"],"member":true,'
    '"home":{"city":"London","floors":[1,2]}}'
)


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def bench_mask() -> None:
    tokenizer = tok_lib.Tokenizer()
    walk = constraints.Walk(constraints.json_answer(PERSON, 0))
    for token in [tok_lib.CHANNEL_ID, *tokenizer.encode("final"), tok_lib.MESSAGE_ID]:
        walk.advance(token)
    row = np.zeros(constraints.mask_words(), np.uint32)
    per_token = []
    for token in tokenizer.encode(ANSWER):
        times = []
        for _ in range(_MASK_REPEATS.value):
            start = time.perf_counter()
            walk.fill(row)
            times.append(time.perf_counter() - start)
        per_token.append(statistics.median(times))
        walk.advance(token)
    _emit(
        {
            "measure": "mask_fill_us",
            "tokens": len(per_token),
            "median": statistics.median(per_token) * 1e6,
            "max": max(per_token) * 1e6,
        }
    )


def _run(engine, prompts, constrained: int, grammar: str) -> tuple[float, list]:
    """Seconds per decode step of one batch, and the free requests' tokens."""
    n = len(prompts)
    params = [
        RequestParams(max_tokens=_TOKENS.value, grammar=grammar if i < constrained else None)
        for i in range(n)
    ]
    start = time.perf_counter()
    done = [h.result() for h in [engine.submit(p, q) for p, q in zip(prompts, params)]]
    seconds = time.perf_counter() - start
    return seconds / _TOKENS.value, [c.tokens for c in done[constrained:]]


def bench_engine(model) -> None:
    n = _SLOTS.value
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 199_000, 32).tolist() for _ in range(n)]
    grammar = constraints.json_answer(LONG_TEXT, 0)
    mixes = {"none": 0, "half": n // 2, "all": n}
    with Engine.from_model(model, max_slots=n, max_context=256, prefill_chunk=32) as engine:
        for constrained in mixes.values():  # compiles the masked programs too
            _run(engine, prompts, constrained, grammar)
        steps = {name: [] for name in mixes}
        free_tokens = {}
        for _ in range(_ROUNDS.value):
            for name, constrained in mixes.items():
                seconds, tokens = _run(engine, prompts, constrained, grammar)
                steps[name].append(seconds)
                free_tokens.setdefault(name, tokens)
    unchanged = free_tokens["half"] == free_tokens["none"][n // 2 :]
    for name, times in steps.items():
        _emit(
            {
                "measure": "decode_step_ms",
                "rows": n,
                "constrained": mixes[name],
                "median": statistics.median(times) * 1e3,
                "runs": [round(t * 1e3, 2) for t in times],
                "device": jax.devices()[0].device_kind,
            }
        )
    _emit({"measure": "free_rows_unchanged_beside_constrained", "value": unchanged})


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    runtime.setup_process(sharding.platform())
    model = loading.random_model(_CONFIG.value, devices=jax.devices()[:1])
    if model.cfg.vocab_size != tok_lib.VOCAB_SIZE:
        raise SystemExit(
            errors.report(
                errors.UserError(
                    f"a grammar needs the Harmony vocabulary: add "
                    f"--config.model.vocab_size={tok_lib.VOCAB_SIZE}"
                )
            )
        )
    bench_mask()
    bench_engine(model)


if __name__ == "__main__":
    app.run(main, flags_parser=errors.parse_flags)
