"""Digits with a mapping target, for networks with more than one head."""

from __future__ import annotations

from echelon3.datasets.digits import Digits


class DigitsParity(Digits):
    """:class:`Digits` whose target is ``{"digit": label, "parity": label % 2}``."""

    def __getitem__(self, index: int):
        image, label = super().__getitem__(index)
        return image, {"digit": label, "parity": label % 2}
