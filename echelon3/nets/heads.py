"""A network with two named outputs, and the module that keeps one of them.

:class:`TwoHeadMLP` returns ``{"digit": logits over 10 classes, "parity": logits over
even / odd}`` from one shared hidden layer; losses and metrics read an entry with
``input_key`` (see docs/configuration.md). :class:`PickOutput` keeps one entry, e.g. as
``export.postprocess``, since ``model.onnx`` holds one output.
"""

from __future__ import annotations

import torch
from torch import nn


class TwoHeadMLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: int = 32, num_classes: int = 10,
                 dropout: float = 0.0):
        super().__init__()
        self.trunk = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                   nn.Dropout(dropout))
        self.digit = nn.Linear(hidden, num_classes)
        self.parity = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        return {"digit": self.digit(h), "parity": self.parity(h)}


class PickOutput(nn.Module):
    """``outputs[key]`` of a network that returns a mapping."""

    def __init__(self, key: str):
        super().__init__()
        self.key = key

    def forward(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return outputs[self.key]

    def extra_repr(self) -> str:
        return f"key={self.key!r}"
