"""Held-out evaluation: the mean next-token loss over batches of a data source's eval
split, read from its start each time so evaluations are comparable. Training's periodic
eval and `decode --mode=score --data=SPEC` both run `eval_loss`."""

from __future__ import annotations

from typing import Iterable

import jax

from gpt_oss_train.training import data as data_lib


def eval_loss(eval_step, params, batches: Iterable[dict], mesh, rules, *, whole=False) -> dict:
    """Sums eval_step's (nll, tokens) over the local batches (as the pipeline yields them;
    whole: Pipeline.whole_batches) -> {"loss", "tokens", "batches"}; loss is None when no
    token was scored."""
    nll = tokens = 0.0
    n = 0
    for local in batches:
        batch = data_lib.global_batch(local, mesh, rules, whole=whole)
        a, b = jax.device_get(eval_step(params, batch))
        nll, tokens, n = nll + float(a), tokens + float(b), n + 1
    return {"loss": nll / tokens if tokens else None, "tokens": int(tokens), "batches": n}


def eval_pipeline(
    spec: str, *, seq_len: int, batch_size: int, seed: int, max_docs: int = 0, num_epochs=None
):
    """The eval split of `spec`, unshuffled. A multi-process job takes a fixed number of
    batches from a forever pipeline (num_epochs=None), so its processes stay in step."""
    return data_lib.make_pipeline(
        spec,
        seq_len=seq_len,
        global_batch_size=batch_size,
        seed=seed,
        shuffle=False,
        num_epochs=num_epochs,
        split="eval",
        max_docs=max_docs,
    )


def take(iterator, n: int):
    """The first n items of an iterator (fewer if it ends)."""
    for _ in range(n):
        try:
            yield next(iterator)
        except StopIteration:
            return


def evaluate(setup, params) -> float | None:
    """Training's periodic eval: config.train.eval_batches batches of the held-out split
    (data.eval_source, else the source's own eval split)."""
    c = setup.config
    pipeline = eval_pipeline(
        c.data.eval_source or c.data.source,
        seq_len=c.train.seq_len,
        batch_size=c.train.global_batch_size,
        seed=c.seed,
        max_docs=c.data.max_docs,
    )
    batches = take(pipeline, c.train.eval_batches)
    return eval_loss(
        setup.eval_step, params, batches, setup.mesh, setup.rules, whole=pipeline.whole_batches
    )["loss"]
