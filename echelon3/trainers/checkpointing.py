"""What a trainer checkpoint holds: the state layout, written and read back.

Every checkpoint holds the network (with ``trainer.config.ema``: the average as
``model_state_dict``, the training weights as ``training_model_state_dict``),
optimizer, scheduler, GradScaler, early-stopping state, epoch, step, metrics and
every rank's RNG state. ``epoch`` counts completed epochs (where a resume starts);
``validated_epoch`` names the epoch the validation behind ``metrics`` belongs to, counted
as history records count (1-based, the epoch in progress for a validation in the middle
of one): :func:`echelon3.trainers.validating.validation_epoch` reads it. A checkpoint written in the middle of an epoch adds the
mid-epoch parts (:mod:`echelon3.trainers.state`; written by
:mod:`echelon3.trainers.preempting`). Mixed into the trainer, which provides the
objects named here.
"""

from __future__ import annotations

from typing import Any, Mapping

from echelon3.checkpoints.files import TRAINING_WEIGHTS, strip_prefixes
from echelon3.data.rng import rng_state
from echelon3.trainers.validating import VALIDATED_EPOCH, validation_epoch
from echelon3.distributed.ranks import (all_gather_object, broadcast_buffers_, get_rank,
                                        get_world_size, unwrap)


class Checkpointing:
    def state_dict(self) -> dict[str, Any]:
        """An epoch checkpoint (a collective: every rank's RNG states are gathered, and
        rank 0's buffers become every rank's, so a sharded checkpoint's copy is rank 0's)."""
        broadcast_buffers_(unwrap(self.net), tensors=self.ema.buffers() if self.ema else ())
        weights = strip_prefixes(unwrap(self.net).state_dict())
        return {
            # What evaluate, export and finetune load: the EMA weights when on.
            "model_state_dict": self.ema.state_dict() if self.ema else weights,
            **({TRAINING_WEIGHTS: weights} if self.ema else {}),
            "early_stopping": self.early.state_dict() if self.early else None,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "scheduler_state_dict": self.scheduler.state_dict() if self.scheduler else None,
            "scaler_state_dict": self.precision.state_dict(),
            "epoch": self.epoch,
            "global_step": self.global_step,
            "metrics": dict(self.last_metrics),
            VALIDATED_EPOCH: self.validated_epoch,
            "best_metrics": dict(self.best_metrics) if self.best_metrics else None,
            "rng_state": rng_state(),  # rank 0's; every rank's below, for exact DDP resume
            "rng_states": all_gather_object(rng_state()) if get_world_size() > 1 else None,
            **self.extra_state,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint (the network weights are loaded by the caller)."""
        self.optimizer.load_state_dict(state["optimizer_state_dict"])
        if self.scheduler is not None and state.get("scheduler_state_dict"):
            self.scheduler.load_state_dict(state["scheduler_state_dict"])
        self.precision.load_state_dict(state.get("scaler_state_dict"))
        self.epoch, self.global_step = int(state["epoch"]), int(state["global_step"])
        self.best_metrics = state.get("best_metrics")
        self.last_metrics = dict(state.get("metrics") or {})
        self.validated_epoch = validation_epoch(state)
        if self.ema is not None:
            self.ema.load_state_dict(state["model_state_dict"])
        if self.early is not None and state.get("early_stopping"):
            self.early.load_state_dict(state["early_stopping"])
        if not self.mid_epoch.load(state, get_rank()):
            self._resume_rng = (state.get("rng_states"), state["rng_state"])

    def stopped_early(self) -> str | None:
        """Why early stopping ended the run (None: it did not)."""
        return self.early.reason() if self.early is not None else None

    def check_before_save(self) -> None:
        """Before any checkpoint: pending log records out, and the non-finite check."""
        self._flush_logs()
        self.nonfinite.check_before_save(self._params())
