"""What a training loop watches so that it never trains on without a way back: steps whose
loss or gradient norm was not finite (skipped by the train step, counted here), and the
reasons to stop that one process may see alone (SIGTERM, a failed save, a lost workdir
lock), which every process must act on together.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils


class SkippedSteps:
    """Counts the steps whose update the train step skipped (metrics["skipped"], see
    steps.update_if_finite) and how many of them are in a row.

    Each step's flag is read one step late (`settle(step - 1)` after the next step is
    dispatched), so the host never waits for the device just to look at it; before a save,
    `settle(step)` reads up to the step being saved. `diverged` turns true once `limit`
    steps in a row were skipped.
    """

    def __init__(self, limit: int, total: int = 0):
        self.limit, self.total, self.in_a_row = limit, total, 0
        self.last_skipped: int | None = None
        self._pending: list[tuple[int, dict]] = []

    def push(self, step: int, out: dict) -> None:
        self._pending.append((step, {k: out[k] for k in ("skipped", "loss", "grad_norm")}))

    def settle(self, upto: int) -> None:
        while self._pending and self._pending[0][0] <= upto:
            step, flags = self._pending.pop(0)
            flags = jax.device_get(flags)
            if not flags["skipped"]:
                self.in_a_row = 0
                continue
            self.total += 1
            self.in_a_row += 1
            self.last_skipped = step
            logging.warning(
                "step %d: loss %s, grad_norm %s: not finite, update skipped (parameters and "
                "optimizer state unchanged); %d in a row, the run stops at %d",
                step,
                _show(flags["loss"]),
                _show(flags["grad_norm"]),
                self.in_a_row,
                self.limit,
            )

    @property
    def diverged(self) -> bool:
        return self.in_a_row >= self.limit


def _show(x) -> str:
    x = float(x)
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def agree_any(*flags: bool) -> tuple[bool, ...]:
    """Each flag, true on every process if it is true on any (one small collective)."""
    if jax.process_count() == 1:
        return tuple(bool(f) for f in flags)
    gathered = multihost_utils.process_allgather(np.array(flags, dtype=bool))
    return tuple(bool(f) for f in np.asarray(gathered).reshape(-1, len(flags)).any(axis=0))
