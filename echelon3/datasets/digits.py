"""scikit-learn's handwritten digits (1,797 8x8 images, 10 classes), shipped with the package."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


class Digits(Dataset):
    """A deterministic stratified split; images normalised to zero mean, unit variance, 1x8x8.

    ``limit`` keeps the first N samples of the split (small test sets for tests).
    """

    def __init__(self, split: str = "train", test_fraction: float = 0.25, seed: int = 0,
                 limit: int | None = None):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        data = load_digits()
        images = data.images.astype(np.float32) / 16.0
        x_train, x_test, y_train, y_test = train_test_split(
            images, data.target, test_size=test_fraction, random_state=seed,
            stratify=data.target)
        mean, std = x_train.mean(), x_train.std()
        x, y = (x_train, y_train) if split == "train" else (x_test, y_test)
        if limit is not None:
            x, y = x[:limit], y[:limit]
        self.images = torch.from_numpy((x - mean) / std).unsqueeze(1).contiguous()
        self.labels = torch.from_numpy(y.astype(np.int64))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]
