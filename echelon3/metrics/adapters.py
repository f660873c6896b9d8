"""Metrics configured with more than a metric object: a function, or one entry of a mapping.

``partial: true`` on a ``metrics`` entry gives a function ``fn(preds, target) -> number``
(``torchmetrics.functional.accuracy`` bound to its config, say). :class:`FunctionMetric`
makes it a :class:`~echelon3.metrics.base.Metric`: each batch's value is weighted by the
batch's size, summed, and the sums are added across ranks before ``compute()``. That is
exact for a mean over samples (accuracy, mean squared error, a mean loss); a ratio over
the whole set (F1, AUROC) is not a mean of batch values and wants its metric class.

``input_key`` / ``target_key`` on an entry (:class:`KeyedMetric`) feed it one entry of a
network that returns a mapping, and of a mapping target.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from echelon3.data.batches import Keyed, batch_size
from echelon3.metrics.base import Metric, all_reduce_sum_


class FunctionMetric(Metric):
    """The size-weighted mean over batches of ``fn(preds, target)``, exact across ranks."""

    def __init__(self, fn: Callable[[Any, Any], Any]):
        self.fn = fn
        self.total = torch.zeros((), dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.float64)

    def update(self, preds, target) -> None:
        value = torch.as_tensor(self.fn(preds, target)).detach()
        n = batch_size(target)
        self.total = self.total + value.to(self.total.device, torch.float64) * n
        self.count = self.count + n

    def compute(self) -> torch.Tensor:
        return self.total / self.count.clamp(min=1)

    def reset(self) -> None:
        self.total = torch.zeros_like(self.total)
        self.count = torch.zeros_like(self.count)

    def dist_reduce(self) -> None:
        all_reduce_sum_(self.total, self.count)

    def __repr__(self) -> str:
        return f"FunctionMetric({self.fn!r})"


class KeyedMetric(Metric):
    """``metric`` updated with the ``input_key`` output and the ``target_key`` target."""

    def __init__(self, metric, input_key: str | None, target_key: str | None, key: str):
        self.metric = metric
        self.keyed = Keyed(metric.update, input_key, target_key, key)
        self.input_key = input_key

    @property
    def num_classes(self):
        """The wrapped metric's, so a label outside its classes is named (one target)."""
        return getattr(self.metric, "num_classes", None) if self.keyed.target_key is None \
            else None

    def update(self, preds, target) -> None:
        self.metric.update(*self.keyed.select(preds, target))

    def compute(self):
        return self.metric.compute()

    def reset(self) -> None:
        self.metric.reset()

    def dist_reduce(self) -> None:
        if isinstance(self.metric, Metric):
            self.metric.dist_reduce()

    def to(self, device) -> "KeyedMetric":
        self.metric = self.metric.to(device)
        return self

    def __repr__(self) -> str:
        return (f"KeyedMetric({self.metric!r}, input_key={self.input_key!r}, "
                f"target_key={self.keyed.target_key!r})")
