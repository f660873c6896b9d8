"""A small stream for the stream tests: ``(features, sample_id)`` with a random
augmentation per sample, drawn from the stream's per-sample generator."""

from __future__ import annotations

import torch

from echelon3.data.streams import Stream

FEATURES = 3


class NoisyIds(Stream):
    """``size`` samples a pass, in a new order each epoch; sample ``i``'s features are
    ``i`` plus Gaussian noise from the generator :meth:`Stream.shard` seeds for it."""

    def __init__(self, size: int = 24, seed: int | None = None):
        super().__init__(seed)
        self.size = size

    def __iter__(self):
        for index in self.shard(self.order(self.size)):
            noise = torch.randn(FEATURES, generator=self.generator)
            yield torch.full((FEATURES,), float(index)) + noise, index
