"""`python -m gpt_oss_train.decode`: the decode CLI (cli.py)."""

from absl import app, flags

from gpt_oss_train import errors
from gpt_oss_train.decode import cli

__doc__ = cli.__doc__  # what --help prints: absl reads the __main__ module's docstring
cli.define_flags()
flags.adopt_module_key_flags(cli)  # and lists the flags of __main__: cli's
app.run(cli.main, flags_parser=errors.parse_flags)
