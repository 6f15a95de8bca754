"""What the console shows: this project's INFO lines, warnings and errors for all.

Orbax and grain log ~40 INFO lines per checkpoint save, which would bury the one metrics
line per log step; a chat should show the conversation, not library chatter. Entry
points call `quiet_library_logs()` once; `--verbosity=1` (absl) brings everything back.
"""

from __future__ import annotations

import os


class _LibraryInfoFilter:
    """Drops INFO-and-below records logged from inside orbax and grain: a checkpoint save
    prints ~40 INFO lines there, which would bury the one metrics line per log step."""

    _NOISY = (f"{os.sep}orbax{os.sep}", f"{os.sep}grain{os.sep}")

    def filter(self, record) -> bool:
        import logging as std_logging

        if record.levelno > std_logging.INFO:
            return True
        return not any(part in record.pathname for part in self._NOISY)


def quiet_library_logs() -> None:
    """Keeps absl INFO for this project, warnings and errors for everyone."""
    from absl import logging

    if logging.get_verbosity() >= logging.DEBUG:
        return
    handler = logging.get_absl_handler()
    if not any(isinstance(f, _LibraryInfoFilter) for f in handler.filters):
        handler.addFilter(_LibraryInfoFilter())


def conversation_only() -> None:
    """For an interactive chat: library INFO and warnings (JAX's backend probe, Orbax's
    read-only notices) would interleave with the conversation, so only errors print,
    unless the user asked for more with --verbosity=1."""
    from absl import logging

    if logging.get_verbosity() <= logging.INFO:
        logging.set_verbosity(logging.ERROR)
