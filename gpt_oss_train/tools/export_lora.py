"""Export a LoRA adapter: as a PEFT adapter folder, or merged into its base as a Hugging
Face checkpoint (bfloat16 / float32, or MXFP4 re-quantized, with the rounding measured).

  # PEFT: peft.PeftModel.from_pretrained(GptOssForCausalLM.from_pretrained(BASE), OUT)
  python -m gpt_oss_train.tools.export_lora --adapter=runs/lora_sft --peft_out=/tmp/adapter

  # merged: one HF folder (tokenizer included) any gpt-oss server loads
  python -m gpt_oss_train.tools.export_lora --adapter=runs/lora_sft --merged_out=/tmp/merged \
      [--mxfp4]

--adapter is a LoRA training workdir (or checkpoint) or a PEFT folder; the base is the
one the workdir records (checkpoint.init_from, else the random base of its seed) unless
--checkpoint names one. Prints a JSON summary (and the MXFP4 re-quantization error).
"""

from __future__ import annotations

import json
import os
import sys

import jax
from absl import app, flags

from gpt_oss_train import config as config_lib
from gpt_oss_train import errors
from gpt_oss_train.checkpoints import checkpoint as ckpt_lib
from gpt_oss_train.inference import adapters as adapters_lib
from gpt_oss_train.inference import loading
from gpt_oss_train.io import hf, lora_export
from gpt_oss_train.io import peft as peft_io
from gpt_oss_train.model import lora
from gpt_oss_train.model.transformer import ModelDef

flags.DEFINE_string("adapter", None, "LoRA training workdir / checkpoint, or a PEFT folder.")
flags.DEFINE_string("checkpoint", "", "The base (HF folder or Orbax); default: the recorded one.")
flags.DEFINE_string("peft_out", "", "Write a PEFT adapter folder here.")
flags.DEFINE_string("merged_out", "", "Write the merged model here (a Hugging Face folder).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Merged tensors' dtype.")
flags.DEFINE_bool("mxfp4", False, "Merged experts re-quantized to MXFP4, as published.")
flags.DEFINE_integer("seed", 0, "The random base's seed when neither is recorded nor given.")


def base_reader(path: str, arch: dict, seed: int):
    """read(path, layers) -> float32 numpy in our layout, from an HF folder, an Orbax
    checkpoint or (path "") the random base of `seed` that training made."""
    if path and not ckpt_lib.is_orbax_checkpoint(path):
        ckpt = hf.HFCheckpoint(path)
        return lambda p, layers: ckpt.read(p, layers)
    md = ModelDef(config_lib.ModelConfig(**arch, param_dtype="float32"))
    if path:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shapes = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), md.abstract_params()
        )
        tree = jax.device_get(ckpt_lib.load_params(path, shapes)[0])
    else:
        tree = jax.device_get(md.init(seed))
    return lambda p, layers: lora.get(tree, p) if layers is None else lora.get(tree, p)[layers]


def main(argv):
    del argv
    f = flags.FLAGS
    try:
        if not f.adapter or not (f.peft_out or f.merged_out):
            raise errors.UserError("give --adapter and at least one of --peft_out, --merged_out")
        meta = _recorded_base(f.adapter)
        base = os.path.abspath(f.checkpoint) if f.checkpoint else meta.get("source", "")
        arch = _architecture(base, f.adapter)
        adapter = adapters_lib.read_adapter(f.adapter, arch)
        summary = {"adapter": adapter.path, "base": base or f"random (seed {meta.get('seed')})"}
        if f.peft_out:
            peft_io.save_peft(f.peft_out, adapter.spec, adapter.tree, arch["num_layers"], base)
            summary["peft_out"] = os.path.abspath(f.peft_out)
        if f.merged_out:
            read = base_reader(base, arch, int(meta.get("seed", f.seed)))
            report = lora_export.save_merged(
                f.merged_out, arch, adapter.spec, adapter.tree, read, dtype=f.dtype, mxfp4=f.mxfp4
            )
            summary.update(merged_out=os.path.abspath(f.merged_out), mxfp4_requant_error=report)
    except (errors.UserError, FileExistsError) as e:
        sys.exit(errors.report(e if isinstance(e, errors.UserError) else errors.UserError(e)))
    print(json.dumps(summary, indent=1))


def _recorded_base(adapter: str) -> dict:
    if not ckpt_lib.is_orbax_checkpoint(adapter):
        return {}
    return ckpt_lib.read_meta(adapter).get(ckpt_lib.LORA_META_KEY, {}).get("base", {})


def _architecture(base: str, adapter: str) -> dict:
    """The base's architecture; for a random base, the one the adapter workdir stores."""
    if base:
        return loading.read_architecture(base, loading.checkpoint_kind(base))
    if ckpt_lib.is_orbax_checkpoint(adapter):
        return ckpt_lib.read_model_config(adapter)
    raise errors.UserError(f"--adapter={adapter} is a PEFT folder: pass its base as --checkpoint")


if __name__ == "__main__":
    app.run(main, flags_parser=errors.parse_flags)
