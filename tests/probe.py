"""Test-only components that record what each rank sees, to check DDP behaviour for real."""

from __future__ import annotations

import json
import os
import signal

import torch
from torch import nn
from torch.utils.data import Dataset

from echelon3.metrics.base import Metric, all_reduce_sum_


class IndexDataset(Dataset):
    """Sample i is (features with i in column 0, label i % classes)."""

    def __init__(self, size: int = 64, features: int = 8, classes: int = 2, seed: int = 0,
                 kill_at: int | None = None):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=g)
        self.x[:, 0] = torch.arange(size, dtype=torch.float32)
        self.y = torch.arange(size) % classes
        self.kill_at = kill_at

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if self.kill_at is not None and i == self.kill_at and torch.utils.data.get_worker_info():
            os.kill(os.getpid(), signal.SIGKILL)  # what the OOM-killer does to a loader worker
        return self.x[i], self.y[i]


class ProbeNet(nn.Module):
    """A linear classifier that logs the sample indices of every training batch per rank.

    ``fail_on_rank`` / ``fail_at_step`` plant an exception; ``kill`` makes it a SIGKILL;
    ``sleep`` slows each step so a test can interrupt a run that is mid-training.
    """

    def __init__(self, log_dir: str | None = None, features: int = 8, classes: int = 2,
                 fail_on_rank: int | None = None, fail_at_step: int = 3, kill: bool = False,
                 sleep: float = 0.0, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(features - 1, classes)
        self.drop = nn.Dropout(dropout)
        self.log_dir, self.fail_on_rank, self.fail_at_step = log_dir, fail_on_rank, fail_at_step
        self.kill, self.sleep, self.steps = kill, sleep, 0

    def forward(self, x):
        if self.training:
            self.steps += 1
            rank = int(os.environ.get("RANK", 0))
            if self.log_dir:
                with open(os.path.join(self.log_dir, f"rank{rank}.jsonl"), "a") as f:
                    f.write(json.dumps({"rank": rank, "pid": os.getpid(),
                                        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                        "world": int(os.environ.get("WORLD_SIZE", 1)),
                                        "batch": x[:, 0].long().tolist()}) + "\n")
            if self.fail_on_rank == rank and self.steps == self.fail_at_step:
                if self.kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"planted failure on rank {rank}")
            if self.sleep:
                import time

                time.sleep(self.sleep)
        return self.fc(self.drop(x[:, 1:]))


class CountingAccuracy(Metric):
    """Counter-based accuracy, exact under DDP through dist_reduce()."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.correct = torch.zeros((), dtype=torch.long)
        self.total = torch.zeros((), dtype=torch.long)

    def update(self, preds, target):
        self.correct += (preds.argmax(-1) == target).sum().cpu()
        self.total += target.numel()

    def dist_reduce(self):
        all_reduce_sum_(self.correct, self.total)

    def compute(self):
        return self.correct.float() / self.total.clamp(min=1)


class SeenSamples(CountingAccuracy):
    """How many samples validation counted in all (must equal the test set size)."""

    def compute(self):
        return self.total.float()


class ShardOnlySeen(Metric):
    """A custom metric without dist_reduce(): sees only its rank's shard."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.total = 0

    def update(self, preds, target):
        self.total += target.numel()

    def compute(self):
        return float(self.total)


class BatchNormNet(nn.Module):
    """An MLP over 8x8 digits with a BatchNorm1d: running statistics each rank updates."""

    def __init__(self, hidden: int = 32, classes: int = 10):
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.BatchNorm1d(hidden),
                                    nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.layers(x)
