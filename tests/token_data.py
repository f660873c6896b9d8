"""A small synthetic token data set for the language-model tests.

Each sample is a sequence of ``length + 1`` tokens that counts up by a per-sample
stride modulo ``vocab_size`` from a random start (so the next token is learnable from
the context), as ``(tokens[:-1], tokens[1:])``; the last ``pad`` targets of every
other sample are -100 (padding, left out by the loss and the token metrics).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Tokens(Dataset):
    def __init__(self, size: int = 64, length: int = 8, vocab_size: int = 16, pad: int = 2,
                 seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(vocab_size, (size, 1), generator=g)
        stride = torch.randint(1, 4, (size, 1), generator=g)
        tokens = (start + stride * torch.arange(length + 1)) % vocab_size
        self.inputs, self.targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        if pad:
            self.targets[::2, -pad:] = -100

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int):
        return self.inputs[i], self.targets[i]
