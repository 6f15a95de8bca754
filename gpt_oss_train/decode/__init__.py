"""The decode command (`python -m gpt_oss_train.decode`, `gpt-oss-decode`): cli.py (flags,
modes, --config's default get_config), requests.py (the JSONL modes generate and score,
--data evaluation), chat.py (interactive Harmony chat), benchmarking.py (time to first
token, prefill and decode tokens/s, and transformers')."""
