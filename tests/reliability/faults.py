"""Test-only components that misbehave on purpose, named in configs by this file's path."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from echelon3.datasets.digits import Digits


class NonFiniteAt(nn.Module):
    """A loss term that is 0 except at the given training steps (1-based), where it is
    ``value`` (``nan``, ``inf``); validation calls are not counted."""

    def __init__(self, steps: list[int] | int = 7, value: str = "nan"):
        super().__init__()
        self.steps = {steps} if isinstance(steps, int) else set(steps)
        self.value = float(value)
        self.calls = 0

    def forward(self, pred, target):
        if not pred.requires_grad:
            return pred.sum() * 0
        self.calls += 1
        return pred.float().mean() * 0 + (self.value if self.calls in self.steps else 0.0)


class BadDigits(Dataset):
    """Digits whose sample ``at`` is broken: ``raise`` (getitem raises), ``shape`` (one
    feature too many), ``dtype`` (float64 input), ``label`` (class 42)."""

    def __init__(self, fault: str = "raise", at: int = 5, split: str = "train",
                 limit: int | None = 96):
        self.data = Digits(split=split, limit=limit)
        self.fault, self.at = fault, at

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        if i != self.at:
            return x, y
        if self.fault == "raise":
            raise ValueError("cannot decode this image")
        if self.fault == "shape":
            return torch.cat([x, x[:1]]), y
        if self.fault == "dtype":
            return x.double(), y
        if self.fault == "label":
            return x, torch.as_tensor(42)
        raise AssertionError(self.fault)
