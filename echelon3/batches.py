"""What a batch is: split into inputs and target, moved to the device, scored by the losses.

Shared by the trainer, validation, ``evaluate``, ``run`` and ``export``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch


def split_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    if isinstance(batch, Sequence) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping) and {"input", "target"} <= set(batch):
        return batch["input"], batch["target"]
    raise TypeError("a batch must be (input, target) or a mapping with 'input' and 'target'")


def to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Mapping):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_device(v, device) for v in value)
    return value


def match_target(pred: torch.Tensor, target: torch.Tensor, float_labels: bool = False):
    """Squeeze trailing singleton dims of ``pred`` down to ``target``'s rank."""
    while pred.dim() > target.dim() and pred.shape[-1] == 1:
        pred = pred.squeeze(-1)
    return pred, (target.float() if float_labels else target)


def weighted_loss(losses: Mapping, pred, target, float_labels: bool = False):
    """Σ weight · loss(pred, target) -> (total, {name: part})."""
    pred, target = match_target(pred, target, float_labels)
    parts, total = {}, None
    for name, (fn, weight) in losses.items():
        parts[name] = part = fn(pred, target)
        term = part if weight == 1 else weight * part  # no extra kernel for weight 1
        total = term if total is None else total + term
    return total, parts
