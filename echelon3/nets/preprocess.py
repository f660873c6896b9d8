"""Input transforms that can be fused in front of a network (``export.preprocess``)."""

from __future__ import annotations

from torch import nn


class Standardize(nn.Module):
    """``(x * scale - mean) / std`` in float32: a typical preprocess for raw inputs.

    The arithmetic is the one a dataset that standardises in float32 does, in the
    same order, so the result is the dataset's to the last bit.
    """

    def __init__(self, mean: float = 0.0, std: float = 1.0, scale: float = 1.0):
        super().__init__()
        self.mean, self.std, self.scale = float(mean), float(std), float(scale)

    def forward(self, x):
        return (x.float() * self.scale - self.mean) / self.std

    def extra_repr(self) -> str:
        return f"mean={self.mean!r}, std={self.std!r}, scale={self.scale!r}"
