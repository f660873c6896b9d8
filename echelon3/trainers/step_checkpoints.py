"""Checkpoints every N steps (``target.every_n_steps``) or minutes (``target.every_n_minutes``).

A step checkpoint is a mid-epoch checkpoint, like a preemption's: the epoch state
(:mod:`echelon3.trainers.checkpointing`) and every per-step part
(:mod:`echelon3.trainers.state`), so a run killed at any instant (SIGKILL, the OOM
killer, a lost node) resumes from the newest one exactly as if it had not stopped, having
lost at most N steps. It is written after the N-th optimizer step (no accumulation window is
open then), as ``checkpoint-<epoch>-step<step>.tar`` (a ``.dcp`` folder under FSDP), and the
newest ``target.step_checkpoints_to_keep`` of them are kept until an epoch's checkpoint
supersedes them. ``every_n_minutes`` is read on rank 0's clock and reaches the other ranks
in the next log point's collective: the save comes at the first step after that
(``log_every_n_steps`` bounds the delay). A run that ends at ``max_steps`` in the middle of
an epoch ends with such a checkpoint too.
"""

from __future__ import annotations

import logging
import time

from echelon3.config.errors import ConfigError
from echelon3.distributed.ranks import is_main

log = logging.getLogger(__name__)


class StepSaving:
    """When the next step checkpoint is due; ``every_n_steps`` / ``every_n_minutes`` None: never."""

    def __init__(self, every_n_steps=None, every_n_minutes=None):
        for key, value in (("every_n_steps", every_n_steps),
                           ("every_n_minutes", every_n_minutes)):
            if value is not None and (isinstance(value, bool) or
                                      not isinstance(value, int | float) or value <= 0):
                raise ConfigError(f"target.{key}", f"must be a positive number or null, got "
                                  f"{value!r}")
        if every_n_steps is not None and not isinstance(every_n_steps, int):
            raise ConfigError("target.every_n_steps", f"must be a whole number of steps, got "
                              f"{every_n_steps!r}")
        self.every_n_steps, self.minutes = every_n_steps, every_n_minutes
        self.timed = every_n_minutes is not None
        self.due = False  # set from the log point's collective (every_n_minutes)
        self._last = time.monotonic()

    @classmethod
    def of(cls, checkpoints) -> "StepSaving":
        return cls(getattr(checkpoints, "every_n_steps", None),
                   getattr(checkpoints, "every_n_minutes", None))

    def time_is_up(self) -> bool:
        """Rank 0's clock (the other ranks answer False; the collective sums)."""
        return is_main() and time.monotonic() - self._last >= 60 * self.minutes

    def after_step(self, global_step: int) -> bool:
        """A step checkpoint now, after optimizer step ``global_step``?"""
        by_count = self.every_n_steps is not None and global_step % self.every_n_steps == 0
        return by_count or self.due

    def saved(self) -> None:
        self.due, self._last = False, time.monotonic()


class StepCheckpoints:
    """Mixed into the trainer: the mid-epoch checkpoint, written to go on or to stop."""

    def _mid_epoch_checkpoint(self) -> dict:
        """The whole state of this instant (every rank takes part)."""
        self.check_before_save()
        return {**self.state_dict(), **self.mid_epoch.state()}

    def _save_step(self, epoch: int) -> None:
        """A rolling step checkpoint of epoch ``epoch`` (0-based) in progress; training goes on."""
        path = self.checkpoints.save_step(self._mid_epoch_checkpoint())
        self.step_saving.saved()
        log.info("step checkpoint %s (epoch %d, step %d)", path.name, epoch + 1,
                 self.global_step)
