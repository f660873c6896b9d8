"""Host syncs per training step, counted inside a run: echelon3's MLP that turns on
``torch.cuda.set_sync_debug_mode("warn")`` after ``warm`` training forward passes, counts
the synchronizing calls of the next ``steps`` steps (the trainer's as well as the
network's: the mode is process-wide), then writes ``{"syncs": n, "steps": steps}`` to
``$SYNC_COUNT_DIR/rank<RANK>.json`` and turns the mode off. ``gpu_check.py`` uses it under
2-rank NCCL DDP.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from torch import nn


class SyncCountedMLP(nn.Module):
    def __init__(self, warm: int = 20, steps: int = 50, **config):
        super().__init__()
        from echelon3.nets.mlp import MLP

        self.net, self.warm, self.steps = MLP(**config), warm, steps
        self.seen, self.syncs = 0, 0
        self._shown = None

    def _count(self, message, *args, **kwargs) -> None:
        if "synchroniz" in str(message):
            self.syncs += 1
        else:
            self._shown(message, *args, **kwargs)

    def _window(self) -> None:
        """At the start of forward ``warm`` + 1: on; ``steps`` forwards later: off, written."""
        if self.seen == self.warm:
            warnings.simplefilter("always")
            self._shown, warnings.showwarning = warnings.showwarning, self._count
            torch.cuda.set_sync_debug_mode("warn")
        elif self.seen == self.warm + self.steps:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = self._shown
            folder = Path(os.environ["SYNC_COUNT_DIR"])
            (folder / f"rank{os.environ.get('RANK', '0')}.json").write_text(
                json.dumps({"syncs": self.syncs, "steps": self.steps}))

    def forward(self, x):
        if self.training:
            self._window()
            self.seen += 1
        return self.net(x)
