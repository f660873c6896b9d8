"""How long a run lasts and when it validates: epochs, ``max_steps``, ``val_check_interval``.

A run is counted in epochs (``trainer.config.epochs``), in optimizer steps
(``max_steps``, with ``epochs: null``), or both: then it ends at whichever comes first.
``global_step`` counts optimizer steps (accumulation windows), skipped ones included.

Validation happens either ``times_to_validate_per_epoch`` times per epoch (the last at the
epoch's end), or, with ``val_check_interval: N``, after every N-th optimizer step of the
run (counted from its start, across epochs, not at epoch ends) and at its last step;
``validate_at_start`` adds one before the first step of a fresh run, logged at step 0.
In the step mode early stopping counts validations, not epochs.
"""

from __future__ import annotations

from typing import Any

from echelon3.config.errors import ConfigError

KEY = "trainer.config"


def _count(value: Any, key: str, low: int = 1) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{KEY}.{key}", f"must be an integer >= {low} or null, got {value!r}")
    return value


class RunLength:
    def __init__(self, epochs: Any = 10, max_steps: Any = None, val_check_interval: Any = None,
                 validate_at_start: Any = False, times_to_validate_per_epoch: Any = 1):
        self.epochs = _count(epochs, "epochs")
        self.max_steps = _count(max_steps, "max_steps")
        self.interval = _count(val_check_interval, "val_check_interval")
        self.per_epoch = _count(times_to_validate_per_epoch, "times_to_validate_per_epoch")
        if self.epochs is None and self.max_steps is None:
            raise ConfigError(f"{KEY}.epochs", "is null, so trainer.config.max_steps must give "
                              "the run's length; set one of them")
        if self.per_epoch is None:
            self.per_epoch = 1
        if self.interval is not None and self.per_epoch != 1:
            raise ConfigError(f"{KEY}.val_check_interval", "validates every N steps; it "
                              "cannot be combined with times_to_validate_per_epoch "
                              f"({self.per_epoch}): remove one")
        if not isinstance(validate_at_start, bool):
            raise ConfigError(f"{KEY}.validate_at_start", f"must be true or false, got "
                              f"{validate_at_start!r}")
        self.at_start = validate_at_start

    @property
    def by_steps(self) -> bool:
        """Validation (and early stopping) counted in steps."""
        return self.interval is not None

    @property
    def epoch_count(self) -> float:
        """The epochs to loop over (unbounded when only ``max_steps`` ends the run)."""
        return float("inf") if self.epochs is None else self.epochs

    def reached(self, global_step: int) -> bool:
        """``max_steps`` reached."""
        return self.max_steps is not None and global_step >= self.max_steps

    def finished(self, epoch: int, global_step: int) -> str | None:
        """Why nothing is left to train (None: something is)."""
        if self.reached(global_step):
            return f"{global_step} of {self.max_steps} steps already done"
        if self.epochs is not None and epoch >= self.epochs:
            return f"{epoch} of {self.epochs} epochs already done"
        return None

    def validates_after(self, global_step: int) -> bool:
        """The step mode's validation points."""
        return self.interval is not None and global_step % self.interval == 0

    def mid_epoch_points(self, windows: int | None) -> set[int]:
        """The epoch mode's validation points inside an epoch of ``windows`` windows (window
        numbers, 1-based; the epoch's end is not one of them)."""
        if self.by_steps or windows is None:
            return set()
        return {round(windows * (k + 1) / self.per_epoch) for k in range(self.per_epoch - 1)}

    def describe(self) -> str:
        parts = [f"{self.epochs} epochs"] if self.epochs is not None else []
        parts += [f"{self.max_steps} steps"] if self.max_steps is not None else []
        return " or ".join(parts)

    def bar(self, epoch: int, steps: int | None, done: int, global_step: int,
            accum: int) -> tuple[int | None, int, str]:
        """The progress bar's (total, initial, description): micro-batches of the epoch,
        or of the run when it is counted in steps only."""
        if self.epochs is None:
            return (self.max_steps * accum, global_step * accum,
                    f"step {global_step}/{self.max_steps}")
        return steps, done, f"epoch {epoch + 1}/{self.epochs}"
