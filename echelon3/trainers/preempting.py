"""Stopping for a preemption: a step-exact checkpoint of the epoch in progress, then exit.

The signal is noticed at a step boundary (:mod:`echelon3.distributed.preemption`); every
rank takes part in the checkpoint, which holds the epoch state
(:mod:`echelon3.trainers.checkpointing`) and the mid-epoch parts
(:mod:`echelon3.trainers.state`). Mixed into the trainer.
"""

from __future__ import annotations

import logging

from echelon3.distributed import preemption

log = logging.getLogger(__name__)


class Preempting:
    def _preempt(self, epoch: int) -> None:
        """Checkpoint the epoch in progress (every rank takes part) and stop."""
        path = self.checkpoints.save_preempted(self._mid_epoch_checkpoint())
        log.info("%s", preemption.report(epoch + 1, self.global_step, path))
        raise preemption.Preempted(str(path))
