"""A multi-layer perceptron over flattened inputs."""

from __future__ import annotations

from torch import nn


class MLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: int = 128, num_classes: int = 10,
                 depth: int = 2, dropout: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(depth - 1):
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


def make_mlp(hidden: int = 128, num_classes: int = 10, in_features: int = 64) -> MLP:
    """Factory form, for configs that name a function instead of a class."""
    return MLP(in_features=in_features, hidden=hidden, num_classes=num_classes)
