"""MaxText's train step for the same TPU slice, read through the same step model as ours:
the side-by-side figures of docs/AOT.md.

  python -m gpt_oss_train.tools.maxtext_compile --maxtext=/path/to/maxtext/src \
      --model=gpt-oss-20b --topology=v5e:16x16 -- \
      per_device_batch_size=1 max_target_length=4096 dtype=bfloat16 weight_dtype=float32 \
      remat_policy=full attention=flash sparse_matmul=true megablox=true \
      ici_fsdp_parallelism=64 ici_expert_parallelism=4 allow_split_physical_axes=true \
      custom_mesh_and_rule=ep-as-dp use_ring_of_experts=true

`--maxtext` is the `src` folder of a MaxText checkout (github.com/AI-Hypercomputer/maxtext;
nothing of it ships here), today's layout or an older tag's (`src/MaxText`). Its own
`train_compile` builds and compiles the step (base.yml, `model_name`, `compile_topology`
and a synthetic dataset are filled in from the flags; the arguments after `--` are
MaxText's own `key=value` settings); this tool takes the compiled program it makes and
prints what `aot_compile` prints for ours: XLA's memory per chip, the model FLOPs
(training/flops.py counts as MaxText does), and the step model's FLOPs, HBM bytes,
collectives by kind and mesh axes, and estimated step time. `--json=-` prints the whole
result as one JSON object.
"""

from __future__ import annotations

import sys

from absl import app, flags

from gpt_oss_train import errors
from gpt_oss_train.aot import tpu


def main(argv):
    del argv
    # lazy: these load JAX, after tpu.offline_environment() has set its environment
    from gpt_oss_train.aot import maxtext, report, step_model

    f = flags.FLAGS
    compiled, mesh, config = maxtext.compile_maxtext(
        f.maxtext, f.model, f.topology, f.settings or []
    )
    r = maxtext.account(f.model, f.topology, compiled, mesh, config)
    if f.host_gbps:
        step_model.charge_host(r, f.host_gbps)
    report.emit(r, report.maxtext(r), f.json)


if __name__ == "__main__":
    tpu.offline_environment()
    flags.DEFINE_string("maxtext", None, "the src folder of a MaxText checkout", required=True)
    flags.DEFINE_string("model", "gpt-oss-20b", "MaxText's model_name (and our preset's)")
    flags.DEFINE_string("topology", "v5e:16x16", "TPU slice as libtpu names it")
    flags.DEFINE_string("json", "", "also write the result as JSON to this path (- : stdout)")
    flags.DEFINE_multi_string("settings", [], "MaxText key=value settings (or after --)")
    flags.DEFINE_float(
        "host_gbps", 0.0, "Charge host-offload transfers at this many GB/s a chip in the bounds."
    )
    # MaxText's own key=value settings follow `--` (flags there, --helpfull, stay ours).
    if "--" in sys.argv:
        cut = sys.argv.index("--")
        head, extra = sys.argv[:cut], sys.argv[cut + 1 :]
        ours = [a for a in extra if a.startswith("--")]
        sys.argv = head + ours + [f"--settings={a}" for a in extra if not a.startswith("--")]
    app.run(main, flags_parser=errors.parse_flags)
