"""`python -m gpt_oss_train.decode`: the decode CLI (cli.py)."""

from gpt_oss_train.decode import cli

__doc__ = cli.__doc__  # what --help prints: absl reads the __main__ module's docstring
cli.run()
