"""Errors a user can cause, runs that stop themselves, and how entry points report both.

Every error a user can cause derives from `UserError`: its message is one line that names
the thing (a config field, a file, a flag) and the fix. A run that stops itself to protect
its work (a failed checkpoint save, a loss that stays non-finite) raises `RunStopped`, whose
message says what survives and what to do. Entry points catch both, print `error: <message>`
and exit with status 2 (user error) or 1 (stopped run), before any expensive work where
possible; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import sys


class UserError(ValueError):
    """Something the user wrote or pointed at cannot be used; the message says which."""


class ConfigError(UserError):
    """A configuration that cannot run; the message names the field and the fix."""


class RunStopped(RuntimeError):
    """A training run stopped itself so that no finished work is lost; one-line message."""


def report(e: UserError | RunStopped) -> int:
    """Prints the one-line message for an entry point and returns its exit status."""
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2 if isinstance(e, UserError) else 1


def json_error(e: json.JSONDecodeError) -> str:
    """'not valid JSON (<what> at column N)'. Some of json's messages already end in 'at'
    ('Invalid control character at'), which would read 'at at column'."""
    msg = e.msg[: -len(" at")] if e.msg.endswith(" at") else e.msg
    return f"not valid JSON ({msg} at column {e.colno})"
