"""Every `python -m gpt_oss_train...` command in the README and docs/ parses as written:
its module exists, and absl accepts every flag and value it names (config files and
`--config.a.b=v` overrides included), checked by running it with --helpfull appended.
What the commands print when they run is the docs' own business; that they run at all is
this test's."""

import concurrent.futures
import os
import re
import shlex
import subprocess
import sys

import pytest
from support import ROOT

DOCS = ["README.md"] + [
    f"docs/{f}" for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")
]


def _commands() -> list[tuple[str, str]]:
    """(where, command) of each documented command: code lines, backslash continuations
    joined, with optional `[...]` parts and inline `# ...` comments dropped; commands
    naming a placeholder module (`<name>`) are not runnable as written and are left out."""
    found = []
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read().replace("\\\n", " ")
        for m in re.finditer(r"(?:^|`|\s)(python -m gpt_oss_train[^`\n]*)", text, re.M):
            cmd = re.sub(r"\[[^\]]*\]", "", m.group(1).split(" # ")[0]).strip().rstrip(")")
            if "<" not in cmd and len(cmd.split()) > 2:
                found.append((f"{doc}:{text[: m.start()].count(chr(10)) + 1}", cmd))
    return found


COMMANDS = _commands()


def test_the_docs_have_commands():
    assert len(COMMANDS) >= 20, COMMANDS


@pytest.mark.full
def test_every_documented_command_parses():
    env = dict(os.environ, JAX_PLATFORMS="cpu")

    def parse(item):
        where, cmd = item
        argv = [sys.executable, *shlex.split(cmd)[1:], "--helpfull"]
        out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        text = out.stdout + out.stderr
        bad = "Flags parsing error" in text or "\nerror:" in text or "No module named" in text
        return None if not bad and "flags:" in text else f"{where}: {cmd}\n{text[-600:]}"

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        failures = [f for f in pool.map(parse, COMMANDS) if f]
    assert not failures, "\n\n".join(failures)
