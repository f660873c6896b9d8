"""Mixed precision as one object: autocast context, GradScaler and its state, TF32, cudnn.

``auto`` (the default) means bf16 autocast on GPUs that support it and fp32
elsewhere; ``fp32`` disables autocast; ``fp16`` adds a GradScaler. Closure
optimizers (SAMOptimizer, LBFGS) run a double backward that a scaler cannot
follow, so ``fp16`` falls back to ``bf16`` for them, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from echelon3.config.errors import ConfigError

NOTHING = contextlib.nullcontext()  # "no context", reusable: no object per micro-batch

log = logging.getLogger(__name__)

MODES = ("auto", "bf16", "fp16", "fp32")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bf16_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def resolve_mode(requested: str | None, device: torch.device, closure: bool = False,
                 key: str = "trainer.config.precision") -> str:
    """The precision that will actually run, warning where it differs from the request."""
    mode = "auto" if requested is None else str(requested).lower()
    if mode not in MODES:
        raise ConfigError(key, f"unknown precision '{requested}'; choose one of {', '.join(MODES)}")
    if mode == "auto":
        return "bf16" if bf16_supported(device) else "fp32"
    if mode == "fp16" and closure:
        log.warning("%s: fp16 is not supported with closure optimizers (SAMOptimizer, LBFGS); "
                    "using bf16 instead", key)
        return "bf16"
    return mode


class Precision:
    """Built once from the config; the trainer asks it for autocast, backward and step."""

    def __init__(self, mode: str, device: torch.device):
        self.mode = mode
        self.device = torch.device(device)
        self.dtype = _DTYPES.get(mode)
        self.scaler = torch.amp.GradScaler(self.device.type) if mode == "fp16" else None

    @classmethod
    def from_config(cls, device: torch.device, precision: str | None = None, tf32: bool = True,
                    cudnn_benchmark: bool = True, closure: bool = False,
                    key: str = "trainer.config.precision") -> "Precision":
        mode = resolve_mode(precision, torch.device(device), closure, key)
        if torch.device(device).type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
            torch.backends.cudnn.allow_tf32 = bool(tf32)
            torch.backends.cudnn.benchmark = bool(cudnn_benchmark)
        return cls(mode, device)

    def describe(self) -> str:
        if self.device.type != "cuda":
            return self.mode
        return (f"{self.mode} (tf32={torch.backends.cuda.matmul.allow_tf32}, "
                f"cudnn_benchmark={torch.backends.cudnn.benchmark})")

    def autocast(self):
        if self.dtype is None:
            return NOTHING
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def backward_call(self):
        """What the trainer calls with each micro-batch's loss: :meth:`backward`, or without
        a scaler ``Tensor.backward`` itself (one Python frame less per micro-batch)."""
        return self.backward if self.scaler else torch.Tensor.backward

    def step(self, optimizer, closure=None) -> None:
        if self.scaler is not None and closure is not None:
            raise ValueError("a GradScaler cannot step a closure optimizer; resolve_mode "
                             "turns fp16 into bf16 for them")
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        elif closure is not None:
            optimizer.step(closure)
        else:
            optimizer.step()

    def grad_scale(self) -> float:
        """What the gradients are multiplied by (the GradScaler's scale; 1 without one).
        Reads the device: call it when saving, not per step."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
