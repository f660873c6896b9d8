"""Which optimizers take a closure: they evaluate the loss several times per step."""

from __future__ import annotations

import torch


def is_closure_optimizer(optimizer) -> bool:
    """An optimizer declares it with a class attribute ``needs_closure = True`` (as
    :class:`~echelon3.optimizers.sam.SAMOptimizer` and its subclasses do); torch's
    LBFGS is known."""
    return bool(getattr(optimizer, "needs_closure", False)) or isinstance(
        optimizer, torch.optim.LBFGS)
