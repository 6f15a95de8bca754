"""The training job: meshes, gradient accumulation, preemption and resume, workdir safety,
and bad data — on 8 fake CPU devices with a tiny model and the real tokenizer."""

import hashlib
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support import ROOT

from gpt_oss_train import config as config_lib
from gpt_oss_train import sharding
from gpt_oss_train import train as train_lib
from gpt_oss_train.checkpoints import checkpoint as ckpt_lib
from gpt_oss_train.errors import ConfigError
from gpt_oss_train.io import tokenizer as tok_lib
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.training import data as data_lib
from gpt_oss_train.training import steps as steps_lib
from gpt_oss_train.training.metrics import read_metrics_jsonl


def tiny_config(**train_overrides):
    c = config_lib.default_config()
    c.model.update(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_experts=4,
        experts_per_token=2,
        intermediate_size=32,
        sliding_window=8,
    )
    c.dtype = "float32"
    c.remat_policy = "none"
    c.train.update(
        steps=3,
        global_batch_size=8,
        seq_len=16,
        learning_rate=1e-2,
        warmup_steps=1,
        log_every=1,
        loss_chunk_size=16,
        eval_every=0,
    )
    c.train.update(train_overrides)
    c.checkpoint.update(every=0, async_save=False)
    c.data.update(max_docs=64)
    return c


def losses_of(summary):
    return np.array([summary["losses"][s] for s in sorted(summary["losses"])])


@pytest.fixture(scope="module")
def single_device_losses(tmp_path_factory):
    c = tiny_config()
    return losses_of(
        train_lib.train(c, str(tmp_path_factory.mktemp("single")), devices=jax.devices()[:1])
    )


@pytest.mark.parametrize(
    "mesh,moe",
    [
        (dict(data=1, fsdp=8, tensor=1, expert=1), "ragged"),
        (dict(data=2, fsdp=2, tensor=2, expert=1), "ragged"),
        (dict(data=2, fsdp=1, tensor=1, expert=4), "sharded"),
        (dict(data=8, fsdp=1, tensor=1, expert=1), "ragged"),
    ],
)
@pytest.mark.full
def test_meshes_match_single_device(mesh, moe, single_device_losses, tmp_path):
    """Same data, same init, same math: only the order of float32 reductions differs
    between shardings (partial sums per shard, then an all-reduce). Relative rounding of a
    float32 sum is ~1e-7 x log2(terms); after three Adam steps (which normalise gradients,
    so relative noise passes through unshrunk) we see < 1e-6, and allow 1e-5."""
    c = tiny_config()
    c.mesh.update(mesh)
    c.moe_impl = moe
    got = losses_of(train_lib.train(c, str(tmp_path)))
    assert len(got) == 3 and got[-1] < got[0]
    np.testing.assert_allclose(got, single_device_losses, rtol=1e-5)


@pytest.mark.full
def test_expert_parallel_all_to_all_trains_as_the_gather(tmp_path):
    """Tokens sent only to their experts' shards (all-to-all) or gathered to every shard:
    the same pairs through the same experts, so the same losses on the 8-device mesh."""
    runs = {}
    for exchange in ("xla", "all_to_all"):
        c = tiny_config()
        c.mesh.update(data=2, fsdp=1, tensor=1, expert=4)
        c.moe_impl = "sharded"
        c.kernels.expert_parallel = exchange
        runs[exchange] = losses_of(train_lib.train(c, str(tmp_path / exchange)))
    np.testing.assert_allclose(runs["all_to_all"], runs["xla"], rtol=1e-6)


@pytest.mark.full
def test_loss_gathering_the_unembedding_once_trains_as_per_chunk(single_device_losses, tmp_path):
    """train.loss_gather_once: the loss's rows per device under shard_map, the unembedding
    gathered once and each chunk's gradient reduce-scattered; the same losses as one device
    (float32 sums in another order: within the mesh tests' 1e-5)."""
    c = tiny_config()
    c.mesh.update(data=1, fsdp=4, tensor=1, expert=2)
    c.moe_impl = "sharded"
    c.train.loss_gather_once = True
    got = losses_of(train_lib.train(c, str(tmp_path)))
    np.testing.assert_allclose(got, single_device_losses, rtol=1e-5)


@pytest.mark.full
def test_gradient_accumulation_equals_a_bigger_batch():
    """k microbatches summed then divided by the total token count is the same gradient as
    one batch. The MoE load-balancing loss is the exception (it is a product of two
    batch means, so per-microbatch values differ from the whole batch's), hence coef 0.
    The step runs with SGD(lr=1) so the parameter change *is* the gradient (Adam would
    divide near-zero gradients by their own magnitude and magnify float noise). The two
    paths sum float32 terms in different orders: we allow 1e-5 of the largest gradient."""
    md = ModelDef(config_lib.ModelConfig.from_config(tiny_config()))
    pipeline = data_lib.make_pipeline(
        "stdlib", seq_len=16, global_batch_size=8, seed=0, max_docs=64
    )
    batch = jax.tree.map(jnp.asarray, next(pipeline))
    params = md.init(0)
    tx = optax.sgd(1.0)
    grads, metrics = [], []
    for k in (1, 4):
        t = tiny_config(aux_loss_coef=0.0, z_loss_coef=1e-3, grad_accum_steps=k).train
        step = jax.jit(steps_lib.make_train_step(md, tx, lambda _: 1.0, t))
        state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}
        new_state, m = step(state, batch)
        grads.append(jax.tree.map(lambda a, b: a - b, params, new_state["params"]))
        metrics.append(m)
    assert float(metrics[0]["loss"]) == pytest.approx(float(metrics[1]["loss"]), rel=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads[0]))
    assert scale > 0
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale)


def _cli(workdir, *overrides):
    """The user's command with overrides, as a subprocess on one CPU device."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    return [
        sys.executable,
        "-m",
        "gpt_oss_train.train",
        "--config=configs/cpu_tiny.py",
        f"--workdir={workdir}",
        "--config.train.steps=12",
        "--config.train.log_every=1",
        "--config.train.seq_len=16",
        "--config.train.eval_every=0",
        "--config.checkpoint.every=4",
        "--config.data.max_docs=200",
        *overrides,
    ], env


def _losses(workdir):
    return {
        r["step"]: r["loss"]
        for r in read_metrics_jsonl(os.path.join(workdir, "metrics.jsonl"))
        if r.get("loss") is not None
    }


@pytest.mark.parametrize(
    "sig, after",
    [(signal.SIGTERM, 6), pytest.param(signal.SIGKILL, 8, marks=pytest.mark.full)],
    ids=["sigterm", "kill-9"],
)
def test_stop_then_resume_reproduces_the_uninterrupted_run(tmp_path, sig, after):
    """SIGTERM saves and exits 0; kill -9 right after step 8 (its asynchronous save in
    flight) leaves the lock and maybe a partial save. Either way the same command resumes
    from the newest complete checkpoint to the uninterrupted run's losses."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    cmd, env = _cli(full)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]  # a crash: every thread's stack
    cmd, env = _cli(cut)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 240
    while (
        time.time() < deadline
        and max((_losses(cut) if (cut / "metrics.jsonl").exists() else {}) or {0: 0}) < after
    ):
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    # The exit status first, with the run's log: how it ended says more than what it left.
    assert proc.returncode == (0 if sig == signal.SIGTERM else -signal.SIGKILL), err[-4000:]
    found = ckpt_lib.find_step_dir(str(cut))
    assert found is not None, err[-4000:]
    stopped = found[1]
    if sig == signal.SIGTERM:
        assert after <= stopped < 12 and "Preempted" in err
    else:
        assert stopped in (4, 8), stopped
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    want, got = _losses(full), _losses(cut)
    assert sorted(got) == list(range(1, 13)) == sorted(want)
    # same data order and same arithmetic: equal to float32 precision (bitwise here)
    for s in want:
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=0), s


def _tree_digest(path):
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(p.encode())
            h.update(open(p, "rb").read())
    return h.hexdigest()


@pytest.mark.full
def test_workdir_with_another_models_checkpoint_is_refused_and_untouched(tmp_path):
    c = tiny_config(steps=1)
    c.checkpoint.every = 1
    train_lib.train(c, str(tmp_path), devices=jax.devices()[:1])
    before = _tree_digest(tmp_path / "checkpoints")
    other = tiny_config(steps=2)
    other.model.hidden_size = 64
    with pytest.raises(ckpt_lib.CheckpointError, match="hidden_size: checkpoint 32 vs config 64"):
        train_lib.train(other, str(tmp_path), devices=jax.devices()[:1])
    assert _tree_digest(tmp_path / "checkpoints") == before


@pytest.mark.parametrize(
    "source,match",
    [
        ("/no/such/corpus/*.txt", "/no/such/corpus"),
        ("EMPTY", "empty"),
    ],
)
def test_bad_data_fails_before_any_compute(tmp_path, source, match, monkeypatch):
    if source == "EMPTY":
        (tmp_path / "corpus").mkdir()
        (tmp_path / "corpus" / "a.txt").write_text("")
        source = str(tmp_path / "corpus")
    c = tiny_config()
    c.data.source = source

    def no_params(*a, **kw):
        raise AssertionError("parameters were created before the data error was raised")

    monkeypatch.setattr(ModelDef, "init", no_params)
    with pytest.raises(data_lib.DataError, match=match):
        train_lib.train(c, str(tmp_path / "run"), devices=jax.devices()[:1])
    assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(
        tmp_path / "run" / "checkpoints"
    )


@pytest.mark.full
def test_invalid_utf8_is_replaced_counted_and_trains(tmp_path, caplog):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    (corpus / "bad.txt").write_bytes(b"print('caf\xe9')\n" * 20 + b"\xff\xfe tail\n")
    c = tiny_config(steps=2)
    c.data.update(source=str(corpus), max_docs=0)
    summary = train_lib.train(c, str(tmp_path / "run"), devices=jax.devices()[:1])
    assert summary["step"] == 2 and np.isfinite(losses_of(summary)).all()
    assert any("bad.txt" in r.getMessage() and "22" in r.getMessage() for r in caplog.records)


def test_config_errors_are_one_line_and_name_the_field(tmp_path):
    c = tiny_config()
    c.model.num_kv_heads = 3
    with pytest.raises(ConfigError, match=r"config\.model\.num_heads: 4 query heads"):
        config_lib.validate(c)
    c = tiny_config()
    c.model.experts_per_token = 9
    with pytest.raises(ConfigError, match="experts_per_token"):
        config_lib.validate(c)
    c = tiny_config()
    c.model.sliding_window = 0
    with pytest.raises(ConfigError, match="sliding_window"):
        config_lib.validate(c)
    c = tiny_config()
    c.mesh.update(data=3, fsdp=1)
    with pytest.raises(ConfigError, match="config.mesh"):
        train_lib.train(c, str(tmp_path / "unused"))
    c = tiny_config()
    c.logical_axis_rules = (("batch", "nope"),)
    with pytest.raises(ConfigError, match="unknown mesh axis 'nope'"):
        train_lib.train(c, str(tmp_path / "unused"))
    c = tiny_config()
    others = tuple(r for r in config_lib.DEFAULT_RULES if r[0] != "layers")
    c.logical_axis_rules = others + (("layers", "fsdp"),)
    with pytest.raises(ConfigError, match="both 'layers' and 'embed'"):
        sharding.logical_to_spec(("layers", "embed"), c.logical_axis_rules)


def test_cli_rejects_unknown_config_key(tmp_path):
    cmd, env = _cli(tmp_path, "--config.train.stepz=3")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "stepz" in r.stderr


@pytest.mark.full
def test_finetune_init_from_hf_then_from_orbax(tmp_path, read_hf_tree):
    """init_from loads params only, and the architecture comes from the checkpoint (the
    config's model section is ignored). With learning rate 0 the first run leaves the HF
    weights unchanged; a second run initialised from the first run's Orbax checkpoint sees
    the same params on the same first batch, so its first loss is the same number."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    hc = transformers.GptOssConfig(
        vocab_size=201088,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        sliding_window=8,
    )
    transformers.GptOssForCausalLM(hc).save_pretrained(tmp_path / "hf")
    c = tiny_config(steps=1, learning_rate=0.0)
    c.model.hidden_size = 48  # ignored: init_from decides the architecture
    c.checkpoint.update(init_from=str(tmp_path / "hf"), every=1)
    first = train_lib.train(c, str(tmp_path / "a"), devices=jax.devices()[:1])
    arch, want = read_hf_tree(tmp_path / "hf")
    assert ckpt_lib.read_model_config(str(tmp_path / "a"))["hidden_size"] == 32
    md = ModelDef(config_lib.ModelConfig.from_config(c, arch))
    got, _, _ = ckpt_lib.load_params(str(tmp_path / "a"), md.abstract_params())
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(a, np.asarray(b))
    c2 = tiny_config(steps=2)
    c2.checkpoint.init_from = str(tmp_path / "a")
    second = train_lib.train(c2, str(tmp_path / "b"), devices=jax.devices()[:1])
    assert second["losses"][1] == first["losses"][1]
    assert second["losses"][2] != second["losses"][1]  # and it trains from there


@pytest.mark.full
def test_sft_on_harmony_chat_data(tmp_path):
    """The loss falls, and only what the assistant writes is trained: every target with
    loss weight lies after an <|start|>assistant header (found here from the token ids)."""
    c = config_lib.from_file(os.path.join(ROOT, "configs", "sft_chat.py"))
    c.train.update(steps=8, global_batch_size=2, seq_len=64, log_every=1, learning_rate=3e-3)
    c.checkpoint.update(every=0, async_save=False)
    c.data.source = "chat:" + os.path.join(ROOT, "data", "sample_chat.jsonl")
    losses = losses_of(train_lib.train(c, str(tmp_path), devices=jax.devices()[:1]))
    assert len(losses) == 8 and np.isfinite(losses).all()
    assert losses[-2:].mean() < losses[:2].mean() - 0.5

    batch = next(data_lib.make_pipeline(c.data.source, seq_len=64, global_batch_size=2, seed=0))
    assistant = tok_lib.Tokenizer().encode("assistant")
    start = tok_lib.START_ID
    for inputs, mask in zip(batch["inputs"], batch["loss_mask"]):
        # The role of the message a position is in; None where a packed row starts inside
        # a message cut from the previous row (no header to read it from).
        role = None
        for i, token in enumerate(inputs):
            if token == start:
                header = list(inputs[i + 1 : i + 1 + len(assistant)])
                role = "assistant" if header == assistant else "other"
            if mask[i] and role is not None:
                assert role == "assistant", (i, inputs[max(0, i - 8) : i + 1])
        assert 0 < mask.sum() < mask.size
