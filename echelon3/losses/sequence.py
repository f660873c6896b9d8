"""Losses over sequences: (B, T, V) logits against (B, T) token targets.

:class:`SequenceCrossEntropy` is the token-mean cross entropy of a language model,
the positions whose target is ``ignore_index`` (padding) left out:
``F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=...)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SequenceCrossEntropy(nn.Module):
    """Mean cross entropy over the tokens whose target is not ``ignore_index``."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0):
        super().__init__()
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
        self.ignore_index, self.label_smoothing = int(ignore_index), float(label_smoothing)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if logits.dim() != target.dim() + 1 or logits.shape[:-1] != target.shape:
            raise ValueError(f"logits {tuple(logits.shape)} must be target "
                             f"{tuple(target.shape)} plus a vocabulary dimension")
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                               ignore_index=self.ignore_index,
                               label_smoothing=self.label_smoothing)
