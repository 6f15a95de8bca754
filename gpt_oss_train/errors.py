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
import os
import re
import sys

from absl import app, flags

from gpt_oss_train import logs


class UserError(ValueError):
    """Something the user wrote or pointed at cannot be used; the message says which."""


class ConfigError(UserError):
    """A configuration that cannot run; the message names the field and the fix."""


class RunStopped(RuntimeError):
    """A training run stopped itself so that no finished work is lost; one-line message."""


def report(e: Exception) -> int:
    """Prints the one-line message for an entry point and returns its exit status: 1 for a
    stopped run, 2 for a user error (an OSError on a path the user gave, too)."""
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 1 if isinstance(e, RunStopped) else 2


def override_error(argv: list[str], e: Exception) -> UserError:
    """The one-line error for a bad `--config.a.b=v` override. ml_collections raises
    AttributeError/KeyError with a 'did you mean' note, deep in flag parsing (a 55-line
    traceback), or when the default config is defined, at import."""
    while e.args and isinstance(e.args[0], BaseException):
        e = e.args[0]
    text = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
    lines = [line.strip() for line in text.splitlines() if line.strip()] or [type(e).__name__]
    field, hint = lines[0].strip("'\""), " ".join(lines[1:])
    flag = next(
        (a for a in argv[1:] if a.startswith("--config.") and field in a.split("=")[0]),
        "a --config override",
    )
    message = f"{flag}: no config field {field!r}"
    return UserError(message + (f"; {hint[0].lower()}{hint[1:]}" if hint else ""))


_OVERRIDE_ERRORS = (AttributeError, KeyError, TypeError, ValueError)


def define_config_flag(name: str, default: str, help_text: str):
    """config_flags.DEFINE_config_file, with a bad override applied to the default config
    right here reported in one line (exit 2)."""
    # lazy: start-up (~50 ms; CLIs without a --config flag, e.g. tools.pretokenize, skip it)
    from ml_collections import config_flags

    try:
        return config_flags.DEFINE_config_file(name, default, help_text)
    except _OVERRIDE_ERRORS as e:
        sys.exit(report(override_error(sys.argv, e)))
    except OSError:  # the default file is missing and an override was applied to it
        error = config_file_error(name, default)
        if error is None:
            raise
        sys.exit(report(error))


def config_file_error(name: str, value: str) -> UserError | None:
    """The one-line error for a `--config=PATH[:ARG]` whose file cannot be read, or None.
    ml_collections defers that error until the config is first used (a 45-line traceback
    from deep in the run, exit 1)."""
    path = value.split(":", 1)[0]
    if os.path.isfile(path):
        return None
    try:
        os.stat(path)
        reason = "is a folder" if os.path.isdir(path) else "is not a regular file"
    except FileNotFoundError:
        reason = "no such file" + ("" if os.path.isabs(path) else f" (in {os.getcwd()})")
    except NotADirectoryError:
        reason = "no such file (part of its path is a file, not a folder)"
    except OSError as e:
        reason = (e.strerror or type(e).__name__).lower()
    return UserError(
        f"--{name}={value}: {reason}; give a config .py file (configs/ holds the shipped ones)"
    )


def _config_flag_values(argv: list[str]) -> list[tuple[str, str]]:
    """(flag name, value) of each config-file flag given in argv, or left at its default
    (what ml_collections loads)."""
    # lazy: start-up (~50 ms; CLIs without a --config flag, e.g. tools.pretokenize, skip it)
    from ml_collections.config_flags import config_flags as cf

    found = []
    for name in list(flags.FLAGS):
        flag = flags.FLAGS[name]
        if flag.name != name or not isinstance(flag.parser, cf.ConfigFileFlagParser):
            continue
        given = [
            a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            for i, a in enumerate(argv[1:], 1)
            if re.fullmatch(rf"--?{re.escape(name)}(=.*)?", a, re.S)
        ]
        if given:
            found.append((name, given[-1]))
            continue
        try:
            found.append((name, flag.config_filename))  # the default, loaded at definition
        except Exception:  # none recorded (a default that is not a file)
            pass
    return found


_HELP_FLAGS = {"-h", "-?", "--help", "--helpshort", "--helpfull", "--helpxml"}


def _check_config_files(argv: list[str]) -> None:
    if _HELP_FLAGS & set(argv[1:]):
        return  # help needs no config
    for name, value in _config_flag_values(argv):
        error = config_file_error(name, value)
        if error is not None:
            sys.exit(report(error))


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing for `app.run(main, flags_parser=parse_flags)`, with a bad flag or
    a --config file that cannot be read reported in one line, exit 2 (see override_error
    and config_file_error)."""
    _check_config_files(argv)
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        sys.exit(report(UserError(str(e).splitlines()[0])))
    except _OVERRIDE_ERRORS as e:
        sys.exit(report(override_error(argv, e)))


def json_error(e: json.JSONDecodeError) -> str:
    """'not valid JSON (<what> at column N)'. Some of json's messages already end in 'at'
    ('Invalid control character at'), which would read 'at at column'."""
    msg = e.msg[: -len(" at")] if e.msg.endswith(" at") else e.msg
    return f"not valid JSON ({msg} at column {e.colno})"


def run_command(body, argv: list[str]) -> int:
    """The body of a CLI's main(argv): no stray arguments, third-party logs quieted, and a
    UserError reported as one line (its exit status returned)."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logs.quiet_library_logs()
    try:
        return body()
    except UserError as e:
        return report(e)
