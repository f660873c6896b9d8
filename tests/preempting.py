"""A network that preempts its own run once: at training step ``at`` on rank 0 it sends
itself the preemption signal, unless ``marker`` exists (it creates it), so the resumed
attempt trains on undisturbed."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from torch import nn


class PreemptingNet(nn.Module):
    def __init__(self, marker: str, at: int = 5, features: int = 8, classes: int = 2):
        super().__init__()
        self.fc = nn.Linear(features - 1, classes)
        self.marker, self.at, self.steps = Path(marker), at, 0

    def forward(self, x):
        if self.training:
            self.steps += 1
            if self.steps == self.at and int(os.environ.get("RANK", 0)) == 0 and \
                    not self.marker.exists():
                self.marker.touch()
                os.kill(os.getpid(), signal.SIGUSR1)
        return self.fc(x[:, 1:])  # column 0 is the sample's index (tests/probe.py)
