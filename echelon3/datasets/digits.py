"""scikit-learn's handwritten digits (1,797 8x8 images, 10 classes), shipped with the package."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from echelon3.nets.preprocess import Standardize

PIXEL_SCALE = 1 / 16  # load_digits() pixels are 0-16


class Digits(Dataset):
    """A deterministic stratified split; images normalised to zero mean, unit variance, 1x8x8.

    The normalisation is ``(pixels / 16 - mean) / std`` with the mean and standard
    deviation of the train split's ``pixels / 16`` (float32, over all pixels), the
    same for both splits. The dataset declares it, as a dataset that transforms its
    inputs should (``echelon3 export`` and ``echelon3 predict`` read these):

    - ``preprocess``: that transform as a module, raw pixels (``N x 1 x 8 x 8``,
      float32, 0-16, as ``load_digits().images`` holds them) -> the inputs returned;
    - ``raw_input(index)``: sample ``index``'s raw pixels.

    ``limit`` keeps the first N samples of the split (small test sets for tests).
    """

    def __init__(self, split: str = "train", test_fraction: float = 0.25, seed: int = 0,
                 limit: int | None = None):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        data = load_digits()
        pixels = data.images.astype(np.float32)
        x_train, x_test, y_train, y_test = train_test_split(
            pixels, data.target, test_size=test_fraction, random_state=seed,
            stratify=data.target)
        scaled = x_train * np.float32(PIXEL_SCALE)
        self.preprocess = Standardize(scaled.mean(), scaled.std(), scale=PIXEL_SCALE)
        x, y = (x_train, y_train) if split == "train" else (x_test, y_test)
        if limit is not None:
            x, y = x[:limit], y[:limit]
        self.raw = torch.from_numpy(x).unsqueeze(1).contiguous()
        self.images = self.preprocess(self.raw).contiguous()
        self.labels = torch.from_numpy(y.astype(np.int64))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]

    def raw_input(self, index: int) -> torch.Tensor:
        return self.raw[index]
