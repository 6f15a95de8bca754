"""Held-out evaluation: the objective's means (the next-token loss; DPO's loss, reward
margins and preference accuracy) over batches of a data source's eval split, read from its
start each time so evaluations are comparable. Training's periodic eval and `decode
--mode=score --data=SPEC` both run `eval_loss`."""

from __future__ import annotations

from typing import Iterable

import jax

from gpt_oss_train.training import data as data_lib
from gpt_oss_train.training import objectives


def eval_loss(
    eval_step, params, batches: Iterable[dict], mesh, rules, *, whole=False, objective="lm"
) -> dict:
    """Sums eval_step's stats over the local batches (as the pipeline yields them; whole:
    Pipeline.whole_batches) -> {"loss", "tokens", "batches", "metrics"}: metrics are the
    objective's logged means; loss (theirs) is None when nothing was scored."""
    spec = objectives.OBJECTIVES[objective]
    totals = dict.fromkeys(spec.stats, 0.0)
    n = 0
    for local in batches:
        batch = data_lib.global_batch(local, mesh, rules, whole=whole)
        stats = jax.device_get(eval_step(params, batch))
        totals = {k: totals[k] + float(stats[k]) for k in spec.stats}
        n += 1
    metrics = (
        {name: totals[key] / totals[spec.count] for name, key in spec.means.items()}
        if totals[spec.count]
        else {}
    )
    return {
        "loss": metrics.get("loss"),
        "tokens": int(totals["tokens"]),
        "batches": n,
        "metrics": metrics,
    }


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


def evaluate(setup, params) -> dict:
    """Training's periodic eval: config.train.eval_batches batches of the held-out split
    (data.eval_source, else the source's own eval split) -> {"eval_loss": ...}, and for
    DPO the rest of its means ("eval_rewards/accuracies", ...)."""
    c = setup.config
    pipeline = eval_pipeline(
        c.data.eval_source or c.data.source,
        seq_len=c.train.seq_len,
        batch_size=c.train.global_batch_size,
        seed=c.seed,
        max_docs=c.data.max_docs,
    )
    batches = take(pipeline, c.train.eval_batches)
    objective = c.train.objective
    result = eval_loss(
        setup.eval_step,
        params,
        batches,
        setup.mesh,
        setup.rules,
        whole=pipeline.whole_batches,
        objective=objective,
    )
    if objective == "lm":
        return {"eval_loss": result["loss"]}
    return {f"eval_{name}": v for name, v in result["metrics"].items() if name != "aux_loss"}
