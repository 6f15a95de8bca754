"""DPO end to end: preference pairs -> rows that train the reply alone, the errors a user
can make, the loss at the start (log 2 by hand: the policy is its reference), and runs
that learn a preference, with LoRA and with every parameter. The loss and its gradient
against a float64 reference: test_rl_losses.py."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from support import ROOT

from gpt_oss_train import config as config_lib
from gpt_oss_train import train
from gpt_oss_train.errors import ConfigError
from gpt_oss_train.io.tokenizer import Tokenizer
from gpt_oss_train.training import data as data_lib
from gpt_oss_train.training.sources import DataError, PreferencePair

NARROW = dict(hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=16)


def _reply(text):
    return [{"role": "assistant", "channel": "final", "content": text}]


def _pair(question, chosen, rejected, history=()):
    return {
        "prompt": [*history, {"role": "user", "content": question}],
        "chosen": _reply(chosen),
        "rejected": _reply(rejected),
    }


def _write(path, pairs):
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return f"pairs:{path}"


def test_a_pair_trains_its_reply_alone_even_after_earlier_assistant_turns():
    history = [{"role": "user", "content": "Hi"}, *_reply("Hello! Ask me a sum.")]
    pair = PreferencePair(**_pair("What is 2 + 3?", "2 + 3 = 5", "No idea.", history), where="x:1")
    rows = data_lib.pair_rows(pair, seq_len=128)
    tok = Tokenizer()
    for row, reply in zip(range(2), ("2 + 3 = 5", "No idea.")):
        trained = rows["targets"][row][rows["loss_mask"][row] == 1]
        # <|channel|>final<|message|>{reply}<|return|>: what the model writes after the
        # prompt's <|start|>assistant, and nothing of the earlier assistant turn.
        assert tok.decode(trained) == f"<|channel|>final<|message|>{reply}<|return|>"
        n = int(rows["segment_ids"][row].sum())
        full, _ = tok.render_chat_for_training([*pair.prompt, *_reply(reply)])
        assert n == len(full) - 1  # every (input, target) pair of the rendered chat, unpacked
        np.testing.assert_array_equal(rows["inputs"][row][:n], full[:-1])
        np.testing.assert_array_equal(rows["positions"][row][:n], np.arange(n))
    # The two rows share the prompt: they differ only from the reply on.
    prompt_len = int(np.argmax(rows["loss_mask"][0]))
    np.testing.assert_array_equal(rows["inputs"][0][:prompt_len], rows["inputs"][1][:prompt_len])


LONG_QUESTION = "Please add these: " + " + ".join(str(i) for i in range(60))


def test_batches_alternate_chosen_and_rejected(tmp_path):
    pairs = [_pair(f"What is {i} + 1?", f"{i} + 1 = {i + 1}", "Ask later.") for i in range(5)]
    pairs.insert(2, _pair(LONG_QUESTION, "A lot.", "No."))  # its replies start past seq_len
    spec = _write(tmp_path / "p.jsonl", pairs)
    pipe = data_lib.make_pipeline(
        spec,
        seq_len=128,
        global_batch_size=4,
        seed=0,
        shuffle=False,
        num_epochs=1,
        process_index=0,
        process_count=1,
    )
    batches = list(pipe)
    assert len(batches) == 3 and all(b["inputs"].shape == (4, 128) for b in batches)
    tok = Tokenizer()
    replies = []
    for b in batches:
        for r in range(4):
            trained = b["targets"][r][b["loss_mask"][r] == 1]
            replies.append(tok.decode(trained).removeprefix("<|channel|>final<|message|>"))
    # The long pair trains nothing: the loss counts it for 0.
    want = [x for i in range(5) for x in (f"{i} + 1 = {i + 1}<|return|>", "Ask later.<|return|>")]
    assert replies == want[:4] + ["", ""] + want[4:]


def test_a_run_whose_pairs_do_not_fit_seq_len_is_refused(tmp_path):
    spec = _write(tmp_path / "long.jsonl", [_pair(LONG_QUESTION, "A lot.", "No.")] * 3)
    source = data_lib.make_source(spec)
    with pytest.raises(
        DataError, match="none of the first 3 preference pairs .* train.seq_len=128"
    ):
        data_lib.check_pairs_fit(source, 128)
    data_lib.check_pairs_fit(source, 512)


@pytest.mark.parametrize(
    "line, error",
    [
        ({"prompt": [{"role": "user", "content": "q"}], "chosen": _reply("a")}, "missing"),
        (_pair("q", "a", "b") | {"chosen": [{"role": "user", "content": "a"}]}, "assistant"),
        (_pair("q", "a", "b") | {"prompt": []}, '"prompt" must be a non-empty list'),
    ],
)
def test_a_bad_pair_line_is_named_before_training(tmp_path, line, error):
    spec = _write(tmp_path / "bad.jsonl", [_pair("q", "a", "b"), line])
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{error}"):
        data_lib.make_pipeline(
            spec, seq_len=32, global_batch_size=2, seed=0, process_index=0, process_count=1
        )


def _dpo_config(tmp_path, **train):
    c = config_lib.from_file(os.path.join(ROOT, "configs", "dpo.py"))
    c.model.update(NARROW)
    dodges = ("I don't know.", "No idea, sorry.")
    pairs = [
        _pair(f"What is {i} + {i % 7}?", f"{i} + {i % 7} = {i + i % 7}", dodges[i % 2])
        for i in range(40)
    ]
    c.data.source = _write(tmp_path / "train.jsonl", pairs[:32])
    c.data.eval_source = _write(tmp_path / "eval.jsonl", pairs[32:])
    c.train.update(
        dict(
            steps=12,
            global_batch_size=8,
            seq_len=96,
            loss_chunk_size=96,
            log_every=1,
            eval_every=12,
            eval_batches=1,
            learning_rate=2e-2,
        ),
        **train,
    )
    c.checkpoint.update(every=0)
    return c


@pytest.mark.parametrize("objective, source", [("dpo", "chat"), ("lm", "pairs")])
def test_the_objective_and_the_data_must_agree(tmp_path, objective, source):
    c = _dpo_config(tmp_path, objective=objective)
    if source == "chat":
        c.data.source = f"chat:{ROOT}/data/sample_chat.jsonl"
    with pytest.raises(ConfigError, match="config.data.source: .*(needs|holds) preference pairs"):
        train.train(c, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_odd_rows_cannot_hold_pairs(tmp_path):
    c = _dpo_config(tmp_path, global_batch_size=6, grad_accum_steps=2)
    with pytest.raises(ConfigError, match="train.global_batch_size: 6 rows must hold whole"):
        config_lib.validate(c)


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# Both in the full tier (a minute or more each); the DPO loss and its gradient are checked
# against float64 in the default tier (test_rl_losses.py).
@pytest.mark.full
@pytest.mark.parametrize("rank", [8, 0], ids=["lora", "full"])
def test_dpo_starts_at_log_2_and_learns_the_preference(tmp_path, rank):
    """At step 1 the policy is its reference (zero adapters / the starting parameters), so
    every reward is 0 and the loss log 2; training then separates the held-out pairs."""
    c = _dpo_config(tmp_path)
    c.lora.rank = rank
    out = train.train(c, str(tmp_path / "run"))
    rows = _metrics(out["checkpoints"].rsplit("/", 1)[0])
    first = next(r for r in rows if r["step"] == 1 and "loss" in r)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    last = next(r for r in rows if r["step"] == 12 and "eval_loss" in r)
    assert last["eval_rewards/accuracies"] >= 0.9
    assert last["eval_loss"] < math.log(2) - 0.05
