"""Random gpt-oss models small enough for a test, with the real 201,088-id Harmony
vocabulary: where only a grammar (or a chain written into the weights) can make the
output well formed."""

import jax
import numpy as np

from gpt_oss_train import config as config_lib
from gpt_oss_train.io import hf
from gpt_oss_train.model.transformer import ModelDef


def harmony_vocab_config():
    """2 layers of width 16, 4 experts (top 2), a window of 32, float32."""
    config = config_lib.default_config()
    config.model.update(
        hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        intermediate_size=16,
        num_layers=2,
        num_experts=4,
        experts_per_token=2,
        sliding_window=32,
    )
    config.dtype = "float32"
    return config


def random_params(config, seed: int = 0) -> dict:
    """The model's initial parameters as numpy arrays (writable)."""
    md = ModelDef(config_lib.ModelConfig.from_config(config))
    return jax.tree.map(np.array, md.init(seed))


def save_checkpoint(folder, config, params) -> str:
    """A Hugging Face folder of these parameters (float32), as decode and serve load it."""
    hf.save_hf(folder, config_lib.model_arch(config), params, dtype="float32")
    return str(folder)
