"""Gradient clipping, once per optimizer step, and the total gradient norm it records.

``trainer.config.gradient_clip_val`` (null: off) and ``gradient_clip_algorithm``
(``norm``, the default: :func:`torch.nn.utils.clip_grad_norm_`; ``value``:
:func:`torch.nn.utils.clip_grad_value_`). Clipping acts on the window's summed
gradients just before the optimizer steps; under fp16 the GradScaler unscales
them first (its ``step`` then does not unscale again), so the threshold is in
the units of the true gradients. Under DDP the gradients are already averaged,
so every rank clips alike.

With clipping on, each optimizer step's total 2-norm before clipping is kept on
the device, and a train record carries ``grad_norm``, the mean over the
interval's steps whose norm is finite (fp16's overflowed steps, which the
GradScaler skips, are left out). It is a mid-epoch part: norms not yet in a
record are saved and restored like the running losses.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from echelon3.config.errors import ConfigError
from echelon3.trainers.state import own

ALGORITHMS = ("norm", "value")
KEY = "trainer.config.gradient_clip_val"


class GradientClipping:
    def __init__(self, value: float | None, algorithm: str, precision, closure: bool,
                 device=None):
        if algorithm not in ALGORITHMS:
            raise ConfigError("trainer.config.gradient_clip_algorithm",
                              f"must be norm or value, got {algorithm!r}")
        if value is not None and (not isinstance(value, int | float) or value <= 0):
            raise ConfigError(KEY, f"must be a positive number or null, got {value!r}")
        if value is not None and closure:
            raise ConfigError(KEY, "a closure optimizer (SAMOptimizer, LBFGS) steps inside "
                              "its closure, where echelon3 cannot clip; remove "
                              "gradient_clip_val or clip in the optimizer")
        self.value = None if value is None else float(value)
        self.on = self.value is not None  # read every step: an attribute, not a property
        self.algorithm, self.precision, self.device = algorithm, precision, device
        self._norms: list[torch.Tensor] = []

    def clip(self, optimizer, params: Sequence[torch.nn.Parameter]) -> None:
        """Unscale (fp16), record the total norm, clip: just before ``optimizer.step``."""
        if self.value is None:
            return
        grads = [p for p in params if p.grad is not None]
        if self.precision.scaler is not None:
            self.precision.scaler.unscale_(optimizer)
        if self.algorithm == "norm":
            norm = torch.nn.utils.clip_grad_norm_(grads, self.value)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in grads])
            torch.nn.utils.clip_grad_value_(grads, self.value)
        if hasattr(norm, "full_tensor"):  # a DTensor (strategy: fsdp): the whole norm
            norm = norm.full_tensor()
        self._norms.append(norm.detach().float())

    def take(self, world_size: int) -> torch.Tensor | None:
        """This rank's share of the interval's mean finite norm (the ranks' sum is the
        mean), and the count of finite norms; None when clipping is off."""
        if self.value is None:
            return None
        if not self._norms:
            return torch.zeros(2, device=self.device)
        norms, self._norms = torch.stack(self._norms), []
        finite = torch.isfinite(norms)
        total = torch.where(finite, norms, torch.zeros_like(norms)).sum()
        count = finite.sum().float()
        return torch.stack([total / count.clamp(min=1), count]) / world_size

    @staticmethod
    def read(values: Sequence[float]) -> float | None:
        mean, count = values
        return float(mean) if count > 0 else None

    # ------------------------------------------------------------------ mid-epoch state

    def mid_epoch_state(self) -> dict[str, Any]:
        return {"norms": torch.stack(self._norms).cpu()} if self._norms else {}

    def load_mid_epoch_state(self, ranks: Sequence[dict[str, Any]], rank: int) -> None:
        saved = own(ranks, rank)
        self._norms = list(saved["norms"].to(self.device).unbind(0)) if "norms" in saved else []
