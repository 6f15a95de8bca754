"""What the console shows: this project's INFO lines, warnings and errors for all.

Orbax and grain log ~40 INFO lines per checkpoint save, which would bury the one metrics
line per log step; a chat should show the conversation, not library chatter. Entry
points call `quiet_library_logs()` once; `--verbosity=1` (absl) brings everything back.
"""

from __future__ import annotations

import logging as std_logging
import os
import sys

from absl import logging


class _LibraryFilter:
    """Drops library chatter from the console:
    - INFO-and-below records logged from inside orbax, grain, fsspec and gcsfs: a
      checkpoint save prints ~40 INFO lines there, and gs:// reads one per file opened;
    - orbax's ERROR records: every error it logs also reaches its caller as an exception,
      which training reports in one line (a save that fails on a full disk logs hundreds
      of lines of tracebacks there, burying the cause)."""

    _NOISY = tuple(f"{os.sep}{name}{os.sep}" for name in ("orbax", "grain", "fsspec", "gcsfs"))
    _ORBAX = f"{os.sep}orbax{os.sep}"

    def filter(self, record) -> bool:
        if record.levelno >= std_logging.CRITICAL:
            return True
        if record.levelno >= std_logging.ERROR:
            return self._ORBAX not in record.pathname
        if record.levelno > std_logging.INFO:
            return True
        return not any(part in record.pathname for part in self._NOISY)


def _closed_loop_noise(unraisable) -> bool:
    """When a checkpoint save fails, Orbax closes its asyncio loop while TensorStore still
    completes the save's other writes; each completion then tries to wake the closed loop
    and prints an unraisable 'RuntimeError: Event loop is closed' traceback (dozens per
    failed save, after the failure itself has been reported)."""
    e = unraisable.exc_value
    return isinstance(e, RuntimeError) and str(e) == "Event loop is closed"


def quiet_library_logs() -> None:
    """Keeps absl INFO for this project, warnings and errors for everyone (see
    _LibraryFilter and _closed_loop_noise for the exceptions)."""
    if logging.get_verbosity() >= logging.DEBUG:
        return
    handler = logging.get_absl_handler()
    if not any(isinstance(f, _LibraryFilter) for f in handler.filters):
        handler.addFilter(_LibraryFilter())
    previous = sys.unraisablehook
    if getattr(previous, "__name__", "") != "_quiet_unraisable":

        def _quiet_unraisable(unraisable):
            if not _closed_loop_noise(unraisable):
                previous(unraisable)

        sys.unraisablehook = _quiet_unraisable


def conversation_only() -> None:
    """For an interactive chat: library INFO and warnings (JAX's backend probe, Orbax's
    read-only notices) would interleave with the conversation, so only errors print,
    unless the user asked for more with --verbosity=1."""
    if logging.get_verbosity() <= logging.INFO:
        logging.set_verbosity(logging.ERROR)
