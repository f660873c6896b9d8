"""Token-level metrics of a language model: (B, T, V) logits against (B, T) targets.

Both count tokens, not sequences, and leave out the positions whose target is
``ignore_index`` (padding, -100 by default as in torch's cross entropy). They are
torchmetrics metrics whose states are sums, so their value under DDP is exactly the
value on the union of the ranks' tokens, however many each rank holds.

- :class:`TokenAccuracy`: the fraction of counted tokens whose arg-max is the target.
- :class:`Perplexity`: ``exp`` of the token-mean cross entropy
  (``torchmetrics.text.Perplexity``, with ``ignore_index`` -100 by default).
"""

from __future__ import annotations

import torch
from torchmetrics import Metric
from torchmetrics.text import Perplexity as _Perplexity


class TokenAccuracy(Metric):
    """Correct next tokens over counted tokens (``target != ignore_index``)."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, ignore_index: int = -100, **kwargs):
        super().__init__(**kwargs)
        self.ignore_index = int(ignore_index)
        self.add_state("correct", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        if preds.dim() != target.dim() + 1 or preds.shape[:-1] != target.shape:
            raise ValueError(f"preds {tuple(preds.shape)} must be target "
                             f"{tuple(target.shape)} plus a vocabulary dimension")
        counted = target != self.ignore_index
        self.correct += ((preds.argmax(-1) == target) & counted).sum()
        self.total += counted.sum()

    def compute(self) -> torch.Tensor:
        return self.correct.double() / self.total.clamp(min=1)


class Perplexity(_Perplexity):
    """torchmetrics' perplexity over the tokens whose target is not ``ignore_index``."""

    def __init__(self, ignore_index: int | None = -100, **kwargs):
        super().__init__(ignore_index=ignore_index, **kwargs)
