"""Errors a user can cause, and how entry points report them.

Every such error derives from `UserError`: its message is one line that names the thing
(a config field, a file, a flag) and the fix. Entry points catch `UserError`, print
`error: <message>` and exit with status 2, before any expensive work where possible;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys


class UserError(ValueError):
    """Something the user wrote or pointed at cannot be used; the message says which."""


class ConfigError(UserError):
    """A configuration that cannot run; the message names the field and the fix."""


def report(e: UserError) -> int:
    """Prints the one-line message for an entry point and returns its exit status."""
    print(f"error: {e}", file=sys.stderr)
    return 2
