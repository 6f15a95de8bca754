"""Running the project as a user does, or serving it, for the tests: a tool as a subprocess,
the HTTP server in a thread."""

import contextlib
import json
import os
import subprocess
import sys

from gpt_oss_train.inference.engine import Engine
from gpt_oss_train.inference.server.app import create_app
from gpt_oss_train.inference.server.local import ThreadServer
from gpt_oss_train.io import tokenizer as tok_lib
from support import ROOT


def run_tool_json(name: str, *args: str) -> list[dict]:
    """The JSON records `python -m gpt_oss_train.tools.<name> ARGS` prints, run on the CPU
    as a user would (a subprocess); fails the test on a non-zero exit."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    cmd = [sys.executable, "-m", f"gpt_oss_train.tools.{name}", *args]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


@contextlib.contextmanager
def served(checkpoint, *, max_slots, max_context, model_name="tiny-harmony", devices=None, **app):
    """The HTTP server (in a thread, on a free loopback port) over a float32 engine on
    `checkpoint` (on `devices`, default all 8); `app`: create_app's other options."""
    engine = Engine.from_checkpoint(
        checkpoint,
        devices=devices,
        dtype="float32",
        max_slots=max_slots,
        max_context=max_context,
        prefill_chunk=64,
    )
    engine.start()
    app = create_app(
        engine,
        tokenizer=tok_lib.Tokenizer(),
        model_name=model_name,
        max_context=max_context,
        vocab_size=tok_lib.VOCAB_SIZE,
        **app,
    )
    try:
        with ThreadServer(app) as server:
            yield server
    finally:
        engine.stop(0)
