"""What a batch is: split into inputs and target, moved to the device, scored by the losses.

Shared by the trainer, validation, ``evaluate``, ``run`` and ``export``.

A network may return a mapping of outputs (``{"cls": logits, "aux": value}``) and a
batch's target may be a mapping too. A loss or metric configured with ``input_key``
/ ``target_key`` reads that entry (:class:`Keyed`); one configured without them
receives the whole mapping.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import torch

from echelon3.config.errors import UserError, blame


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


def loss_on_device(fn: Any, device) -> Any:
    """A module (a loss with a ``weight`` buffer) moved to ``device``; the tensor arguments
    of a function bound with ``partial: true`` too; anything else as it is."""
    if device is None:
        return fn
    if hasattr(fn, "to"):
        return fn.to(device)
    if isinstance(fn, functools.partial) and any(
            isinstance(v, torch.Tensor) for v in fn.keywords.values()):
        return functools.partial(fn.func, *fn.args, **{
            k: v.to(device) if isinstance(v, torch.Tensor) else v
            for k, v in fn.keywords.items()})
    return fn


def batch_size(target: Any) -> int:
    """The number of samples: the length of the target, or of a mapping's first entry."""
    if isinstance(target, Mapping):
        return batch_size(next(iter(target.values())))
    return len(target)


def to_float(value: Any) -> Any:
    """Every tensor in ``value`` as float32 (labels that a loss wants as floats)."""
    if isinstance(value, torch.Tensor):
        return value.float()
    if isinstance(value, Mapping):
        return {k: to_float(v) for k, v in value.items()}
    return value


def match_target(pred: Any, target: Any, float_labels: bool = False):
    """Squeeze trailing singleton dims of ``pred`` down to ``target``'s rank (both
    tensors; mappings are left to :class:`Keyed`)."""
    if isinstance(pred, torch.Tensor) and isinstance(target, torch.Tensor):
        while pred.dim() > target.dim() and pred.shape[-1] == 1:
            pred = pred.squeeze(-1)
    return pred, (to_float(target) if float_labels else target)


def pick(value: Any, key: str | None, config_key: str, what: str) -> Any:
    """``value[key]`` (``key`` None: ``value``), or an error naming ``config_key``."""
    if key is None:
        return value
    if not isinstance(value, Mapping):
        raise UserError(config_key, f"is '{key}', but the {what} is a "
                        f"{type(value).__name__}, not a mapping of named entries")
    if key not in value:
        raise UserError(config_key, f"'{key}' is not among the {what}'s keys "
                        f"({', '.join(map(str, value))})")
    return value[key]


class Keyed:
    """``fn`` fed the ``input_key`` entry of the network's output and the ``target_key``
    entry of the target (either may be None: the whole value); ``key`` is its config path."""

    def __init__(self, fn, input_key: str | None, target_key: str | None, key: str):
        for name, value in (("input_key", input_key), ("target_key", target_key)):
            if value is not None and not isinstance(value, str):
                raise UserError(f"{key}.{name}", f"must be a string, got {value!r}")
        self.fn, self.input_key, self.target_key, self.key = fn, input_key, target_key, key

    def select(self, pred: Any, target: Any) -> tuple[Any, Any]:
        return match_target(pick(pred, self.input_key, f"{self.key}.input_key", "network output"),
                            pick(target, self.target_key, f"{self.key}.target_key", "target"))

    def __call__(self, pred: Any, target: Any):
        return self.fn(*self.select(pred, target))

    def __repr__(self) -> str:
        return f"Keyed({self.fn!r}, input_key={self.input_key!r}, target_key={self.target_key!r})"


def mapping_error(key: str, pred: Any, fn: Any, error: Exception) -> UserError | None:
    """For a loss or metric without ``input_key`` that failed on a mapping output: the
    error saying which key to set (None when that is not what happened)."""
    if not isinstance(error, TypeError | AttributeError) or not isinstance(pred, Mapping) \
            or isinstance(fn, Keyed) or getattr(fn, "input_key", None) is not None:
        return None
    return UserError(f"{key}.input_key", f"the network returns a mapping (keys "
                     f"{', '.join(map(str, pred))}) that {key} cannot take "
                     f"({type(error).__name__}: {error}); name the output it reads with "
                     "input_key")


def raise_named(key: str, pred: Any, fn: Any, error: Exception):
    """Raise what ``fn`` (the loss or metric at ``key``) raised: as the ``input_key`` hint
    when a mapping output was the cause, else marked with ``key`` (its one closing line)."""
    named = mapping_error(key, pred, fn, error)
    if named is not None:
        raise named from error
    blame(error, key)
    raise error


def weighted_loss(losses: Mapping, pred, target, float_labels: bool = False):
    """Σ weight · loss(pred, target) -> (total, {name: part})."""
    pred, target = match_target(pred, target, float_labels)
    parts, total = {}, None
    for name, (fn, weight) in losses.items():
        try:
            parts[name] = part = fn(pred, target)
        except Exception as e:
            raise_named(f"loss.{name}", pred, fn, e)
        term = part if weight == 1 else weight * part  # no extra kernel for weight 1
        total = term if total is None else total + term
    return total, parts
