"""gpt_oss_train: train, fine-tune and serve GPT-OSS mixture-of-experts models in JAX."""

__version__ = "0.1.0"
