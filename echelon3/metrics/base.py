"""The contract for custom metrics and the helper that makes them exact under DDP.

torchmetrics metrics reduce their own state across ranks inside ``compute()``.
A custom :class:`Metric` has no such machinery: the trainer calls
:meth:`Metric.dist_reduce` on every rank right before ``compute()``, and a
counter-based metric sums its accumulators there with :func:`all_reduce_sum_`.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod

import torch

from echelon3.distributed.ranks import all_reduce_sum_ as _all_reduce_sum

__all__ = ["Metric", "all_reduce_sum_", "is_usable_metric", "reduce_and_compute"]


def all_reduce_sum_(*tensors: torch.Tensor) -> None:
    """Sum each tensor in place across all ranks; a no-op without a process group."""
    _all_reduce_sum(*tensors)


class Metric(ABC):
    """Accumulate over batches with ``update``, read with ``compute``, clear with ``reset``."""

    @abstractmethod
    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None: ...

    @abstractmethod
    def compute(self) -> float | torch.Tensor: ...

    @abstractmethod
    def reset(self) -> None: ...

    def dist_reduce(self) -> None:
        """Combine accumulators across ranks. Called on every rank before ``compute``."""

    def to(self, device) -> "Metric":
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self


def _takes(method, count: int) -> bool:
    try:
        inspect.signature(method).bind(*([None] * count))
    except TypeError:
        return False
    except ValueError:  # no signature to inspect (some builtins): assume it fits
        return True
    return True


def is_usable_metric(obj) -> bool:
    """A metric object: ``update(preds, target)``, ``compute()`` and ``reset()`` that fit."""
    if isinstance(obj, type):
        return False  # a class, not an instance of one
    methods = {name: getattr(obj, name, None) for name in ("update", "compute", "reset")}
    if not all(callable(m) for m in methods.values()):
        return False
    return (_takes(methods["update"], 2) and _takes(methods["compute"], 0)
            and _takes(methods["reset"], 0))


def reduce_and_compute(metric) -> float:
    """``compute()`` after the cross-rank step of a custom metric; returns a float."""
    if isinstance(metric, Metric):
        metric.dist_reduce()
    value = metric.compute()
    if isinstance(value, torch.Tensor):
        value = value.detach().float().cpu()
        value = value.item() if value.numel() == 1 else value.mean().item()
    return float(value)
