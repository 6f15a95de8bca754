"""Pallas interpret mode for the GPU kernels: the very same kernels run on any platform
(slowly), which is how the CPU tests check them and how `config.kernels.<op>` can select a
GPU kernel on a CPU inside `interpret_mode()`."""

from __future__ import annotations

import contextlib
import contextvars

_interpret = contextvars.ContextVar("gpt_oss_train_pallas_interpret", default=False)


@contextlib.contextmanager
def interpret_mode():
    """Run the Pallas GPU kernels in interpret mode inside this block."""
    token = _interpret.set(True)
    try:
        yield
    finally:
        _interpret.reset(token)


def interpreting() -> bool:
    return _interpret.get()


def unavailable(platform: str) -> str | None:
    """The GPU kernels run on a GPU, or anywhere in interpret mode."""
    return None if platform == "gpu" or interpreting() else "needs a GPU (or interpret mode)"
