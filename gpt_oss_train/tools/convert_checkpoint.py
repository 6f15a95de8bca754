"""Convert GPT-OSS checkpoints between Hugging Face safetensors and Orbax.

  # HF (dense or MXFP4) -> Orbax checkpoint that carries its model config
  python -m gpt_oss_train.tools.convert_checkpoint --hf_dir=gpt-oss-20b \
      --output_dir=/ckpt/gpt-oss-20b

  # Orbax (converted, or a training workdir) -> HF safetensors that transformers loads
  python -m gpt_oss_train.tools.convert_checkpoint --orbax_dir=/tmp/run --hf_out=/tmp/run-hf \
      [--dtype=float32]

The HF folder of a model with the o200k_harmony vocabulary also holds tokenizer.json and
tokenizer_config.json (with the Harmony chat template), so `AutoTokenizer` and the servers
built on transformers load the folder alone, offline.

Parameters are placed on all local devices (FSDP over them), read from safetensors one
tensor or one range of layers at a time, and written back one tensor at a time, so the
host never holds more than one tensor beside the sharded model. Neither direction writes
into a folder that already holds a checkpoint.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
from absl import app, flags

from gpt_oss_train import config as config_lib
from gpt_oss_train import errors, sharding
from gpt_oss_train.checkpoints import checkpoint
from gpt_oss_train.io import hf
from gpt_oss_train.model.transformer import ModelDef

_HF_DIR = flags.DEFINE_string("hf_dir", None, "Hugging Face gpt-oss folder to read.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Orbax checkpoint folder to write.")
_ORBAX_DIR = flags.DEFINE_string("orbax_dir", None, "Orbax checkpoint (or workdir) to read.")
_HF_OUT = flags.DEFINE_string("hf_out", None, "Hugging Face folder to write.")
_DTYPE = flags.DEFINE_enum(
    "dtype", "bfloat16", ["bfloat16", "float32"], "Tensor dtype of the written HF safetensors."
)
_MXFP4 = flags.DEFINE_bool("mxfp4", False, "Write HF expert weights as MXFP4 blocks/scales.")
_PARAM_DTYPE = flags.DEFINE_enum(
    "param_dtype", "float32", ["float32", "bfloat16"], "dtype of the Orbax parameters."
)


def hf_to_orbax(hf_dir: str, output_dir: str, param_dtype: str = "float32") -> dict:
    if checkpoint.find_step_dir(output_dir) is not None:
        raise checkpoint.CheckpointError(
            f"{output_dir} already holds a checkpoint; choose an empty folder"
        )
    arch = hf.HFCheckpoint(hf_dir).model_config  # validates every tensor up front
    c = config_lib.default_config()
    c.param_dtype = param_dtype
    md = ModelDef(config_lib.ModelConfig.from_config(c, arch))
    mesh = sharding.make_mesh(
        dict(data=1, fsdp=-1, tensor=1, expert=1), devices=jax.local_devices()
    )
    params = hf.load_sharded(hf_dir, md.abstract_params(mesh, config_lib.DEFAULT_RULES))
    checkpoint.save_params_only(output_dir, params, arch)
    return arch


def orbax_to_hf(orbax_dir: str, hf_out: str, dtype: str = "bfloat16", mxfp4: bool = False) -> dict:
    if os.path.isdir(hf_out) and os.listdir(hf_out):
        raise FileExistsError(f"{hf_out} is not empty; choose a new folder")
    arch = checkpoint.read_model_config(orbax_dir)
    c = config_lib.default_config()
    md = ModelDef(config_lib.ModelConfig.from_config(c, arch))
    mesh = sharding.make_mesh(
        dict(data=1, fsdp=-1, tensor=1, expert=1), devices=jax.local_devices()
    )
    params, _, _ = checkpoint.load_params(
        orbax_dir, md.abstract_params(mesh, config_lib.DEFAULT_RULES)
    )

    def get_param(path: str, layers):
        arr = params
        for k in path.split("/"):
            arr = arr[k]
        if layers is not None:
            arr = arr[layers]
        return np.asarray(jax.device_get(arr), dtype=np.float32)

    hf.save_hf(hf_out, arch, get_param, dtype=dtype, mxfp4=mxfp4)
    return arch


def main(argv):
    del argv
    try:
        convert()
    except (errors.UserError, OSError) as e:  # a path or file the user gave: one line
        sys.exit(errors.report(e))


def convert():
    if bool(_HF_DIR.value) == bool(_ORBAX_DIR.value):
        raise app.UsageError(
            "give exactly one of --hf_dir (with --output_dir) or --orbax_dir (with --hf_out)"
        )
    if _HF_DIR.value:
        if not _OUTPUT_DIR.value:
            raise app.UsageError("--hf_dir needs --output_dir (the Orbax folder to write)")
        arch = hf_to_orbax(_HF_DIR.value, _OUTPUT_DIR.value, _PARAM_DTYPE.value)
        print(
            f"wrote Orbax checkpoint {_OUTPUT_DIR.value} ({arch['num_layers']} layers, "
            f"{arch['num_experts']} experts)"
        )
    else:
        if not _HF_OUT.value:
            raise app.UsageError("--orbax_dir needs --hf_out (the HF folder to write)")
        arch = orbax_to_hf(_ORBAX_DIR.value, _HF_OUT.value, _DTYPE.value, _MXFP4.value)
        has_tokenizer = os.path.exists(os.path.join(_HF_OUT.value, "tokenizer.json"))
        print(
            f"wrote Hugging Face checkpoint {_HF_OUT.value} ({_DTYPE.value}"
            f"{', MXFP4 experts' if _MXFP4.value else ''}, "
            f"{'with' if has_tokenizer else 'no'} tokenizer: vocabulary {arch['vocab_size']})"
        )


if __name__ == "__main__":
    from gpt_oss_train import errors

    app.run(main, flags_parser=errors.parse_flags)
