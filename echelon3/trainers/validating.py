"""Validation during training: which sets and metrics, keep-best, ``best.tar``.

Validation runs on every rank over its shard, through the network without its
DDP wrapper (:func:`echelon3.trainers.evaluation.evaluate_sets`, the numbers ``evaluate``
computes); metrics reduce across ranks, so keep-best decides the same on every
rank. Only rank 0 writes (checkpoint manager and logger enforce that). Buffers (BatchNorm's
running statistics) are rank 0's on every rank first
(:func:`echelon3.distributed.ranks.broadcast_buffers_`): each rank updated its own copy in
its last training forward, and rank 0's are what ``best.tar`` holds.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Mapping, Sequence

from torch.nn.parallel import DistributedDataParallel

from echelon3.config.errors import ConfigError, blame
from echelon3.distributed.ranks import broadcast_buffers_
from echelon3.trainers.evaluation import evaluate_sets, metric_name
from echelon3.trainers.selection import KeepBest

log = logging.getLogger(__name__)

# In a checkpoint: the epoch (1-based, as history records count it) of the validation that
# gave its ``metrics``; ``epoch`` beside it counts completed epochs.
VALIDATED_EPOCH = "validated_epoch"


def validation_epoch(state: Mapping[str, Any]) -> int:
    """The epoch a checkpoint's ``metrics`` were validated in, as its history record says
    (a validation in the middle of epoch 2 belongs to epoch 2, though 1 epoch is complete).
    Checkpoints written before the key was kept validated at epoch ends only."""
    value = state.get(VALIDATED_EPOCH)
    return int(state["epoch"]) if value is None else int(value)


# Keys of every history record; a loss or metric of that name would overwrite one.
RESERVED = ("split", "epoch", "step", "lr", "grad_norm")


def _check_names(losses: Mapping, metrics: Mapping) -> None:
    taken = (*RESERVED, "loss")
    for section, names in (("loss", losses), ("metrics", metrics)):
        for name in names:
            if name in taken or "/" in name:
                raise ConfigError(f"{section}.{name}", "this name is taken by the history "
                                  f"records ({', '.join(taken)}) or contains '/'; rename it")


class Validation:
    """Mixed into the trainer, which provides the network, loaders, metrics, logger,
    checkpoints and :meth:`check_before_save`."""

    def setup_validation(self, metrics_on: str | Sequence[str] | None, keep_best_on: Any,
                         high_is_better: bool, progress_bar: bool) -> None:
        from echelon3.distributed.ranks import is_main

        self.progress_bar = progress_bar and is_main()
        sets = [metrics_on] if isinstance(metrics_on, str) else list(metrics_on
                                                                    or self.test_loaders)
        unknown = [s for s in sets if s not in self.test_loaders]
        if unknown:
            raise ConfigError("trainer.config.metrics_on", f"unknown test set '{unknown[0]}'; "
                              f"known: {', '.join(self.test_loaders)}")
        self.metric_sets = sets
        _check_names(self.losses, self.metrics)
        self.keep_best = KeepBest(keep_best_on, high_is_better, self.metric_names(),
                                  sets[0] if self.named_sets else None)
        self.best_metrics: dict[str, float] | None = None
        self.last_metrics: dict[str, float] = {}
        self.validated_epoch = 0  # of last_metrics (VALIDATED_EPOCH)

    def metric_names(self) -> list[str]:
        names = [metric_name(s, "loss", self.named_sets) for s in self.test_loaders]
        names += [metric_name(s, m, self.named_sets) for s in self.metric_sets
                  for m in self.metrics]
        return names

    def evaluate(self) -> dict[str, float]:
        """Validation through the network without its DDP wrapper (the EMA weights when
        ``trainer.config.ema`` is on), every rank on its shard."""
        net = self.net.module if isinstance(self.net, DistributedDataParallel) else self.net
        averaged = self.ema.swapped_in() if getattr(self, "ema", None) is not None \
            else contextlib.nullcontext(net)
        try:
            with averaged as net:
                broadcast_buffers_(net)  # every rank validates rank 0's buffers, the saved ones
                return evaluate_sets(net, self.test_loaders, self.metrics,
                                     precision=self.precision, device=self.device,
                                     losses=self.losses, named_sets=self.named_sets,
                                     metric_sets=self.metric_sets,
                                     float_labels=self.float_labels, progress=self.progress_bar)
        except Exception as e:
            blame(e, during="validation")
            raise

    def validate(self, epoch: int, save_best: bool = True) -> bool:
        """Validate during ``epoch`` (1-based, the epoch in progress or just finished);
        True when keep-best took this result (saved as best.tar if ``save_best``)."""
        self.check_before_save()
        metrics = self.evaluate()
        self.last_metrics, self.validated_epoch = metrics, epoch
        best = self.keep_best.is_better(metrics, self.best_metrics)
        if best:
            self.best_metrics = dict(metrics)
        self.logger.log({"split": "val", "epoch": epoch, "step": self.global_step, **metrics})
        summary = " | ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        log.info("epoch %d step %d | %s%s", epoch, self.global_step, summary,
                 " | new best" if best else "")
        if best and save_best:
            self.checkpoints.save_best(self.state_dict())
        return best
