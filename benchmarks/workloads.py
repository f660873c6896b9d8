"""The work both sides of a parity run do: datasets, networks and settings per row.

Each workload is plain data (:class:`Workload`); ``handwritten.py`` builds it by
hand and ``parity.py`` writes it as an echelon3 config, so both run exactly the
same model, data, loader, loss, optimizer, scheduler, validation and checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import Dataset


class Blobs(Dataset):
    """Gaussian clusters, one per class, generated once from ``seed`` and held in memory."""

    def __init__(self, size: int = 40_000, features: int = 32, classes: int = 10,
                 seed: int = 0, split: str = "train"):
        g = torch.Generator().manual_seed(seed + (0 if split == "train" else 1))
        centres = torch.randn(classes, features, generator=torch.Generator().manual_seed(seed))
        self.labels = torch.randint(0, classes, (size,), generator=g)
        self.inputs = centres[self.labels] + 1.5 * torch.randn(size, features, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.inputs[index], self.labels[index]


class Images(Dataset):
    """Random 3x32x32 images whose class shifts the mean of one channel (CIFAR-sized)."""

    def __init__(self, size: int = 50_000, classes: int = 10, seed: int = 0,
                 split: str = "train"):
        g = torch.Generator().manual_seed(seed + (0 if split == "train" else 1))
        self.labels = torch.randint(0, classes, (size,), generator=g)
        self.seeds = torch.randint(0, 2**31, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(int(self.seeds[index]))
        image = torch.randn(3, 32, 32, generator=g)
        label = self.labels[index]
        image[label % 3] += 0.1 * float(label)
        return image, label


def conv_net(width: int = 64, classes: int = 10) -> nn.Module:
    """A small VGG-style conv net for 3x32x32 inputs (no torchvision needed)."""
    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True)]

    return nn.Sequential(*block(3, width), *block(width, width), nn.MaxPool2d(2),
                         *block(width, 2 * width), *block(2 * width, 2 * width), nn.MaxPool2d(2),
                         *block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4 * width, classes))


@dataclass(frozen=True)
class Workload:
    """One row: what to train and how, in the terms of an echelon3 config."""

    name: str
    device: str  # cpu | cuda
    net: dict  # {module, type, config}
    data: dict  # {module, type, config} of the train set; the test set adds split=test
    batch_size: int
    test_batch_size: int
    optimizer: dict
    scheduler: dict
    epochs: int
    precision: str = "fp32"
    num_workers: int = 0
    pin_memory: bool = False
    drop_last: bool = True
    test_size: int | None = None  # overrides data.config.size for the test set
    metrics: tuple = ("accuracy",)
    trainer_extra: dict = field(default_factory=dict)
    nproc: int = 1  # gloo ranks on the CPU (echelon3's ``nproc``; torchrun's --nproc_per_node)


def _blobs(size: int) -> dict:
    return {"module": "benchmarks.workloads", "type": "Blobs", "config": {"size": size}}


_MLP = {"module": "echelon3.nets.mlp", "type": "MLP",
        "config": {"in_features": 32, "hidden": 64, "depth": 2}}
_SGD = {"module": "torch.optim", "type": "SGD", "config": {"lr": 0.02, "momentum": 0.9}}
_STEP = {"module": "torch.optim.lr_scheduler", "type": "StepLR",
         "config": {"step_size": 2, "gamma": 0.5}}


def workloads(smoke: bool = False) -> dict[str, Workload]:
    """Every row; ``smoke`` shrinks each to a few steps (a correctness run, not a timing)."""
    scale = 50 if smoke else 1
    rows = [
        Workload("tiny MLP, batch 8, 5,000 steps/epoch", "cpu", _MLP, _blobs(40_000 // scale),
                 8, 256, _SGD, _STEP, epochs=3 if smoke else 5, test_size=2_000 // scale),
        Workload("digits CNN, batch 32", "cpu",
                 {"module": "echelon3.nets.cnn", "type": "SmallCNN",
                  "config": {"width": 32, "dropout": 0.1}},
                 {"module": "echelon3.datasets.digits", "type": "Digits",
                  "config": {"split": "train"} | ({"limit": 200} if smoke else {})},
                 32, 128, {"module": "torch.optim", "type": "AdamW",
                           "config": {"lr": 0.003, "weight_decay": 0.0001}},
                 {"module": "torch.optim.lr_scheduler", "type": "CosineAnnealingLR",
                  "config": {"T_max": 10}}, epochs=3 if smoke else 8,
                 metrics=("accuracy", "macro_f1")),
        Workload("GPU: tiny MLP, batch 8, 2,500 steps/epoch", "cuda", _MLP,
                 _blobs(20_000 // scale), 8, 256, _SGD, _STEP, epochs=3 if smoke else 4,
                 test_size=2_000 // scale),
        Workload("GPU: conv net bf16, 50,000 32x32 images, batch 256, 4 workers", "cuda",
                 {"module": "benchmarks.workloads", "type": "conv_net", "config": {}},
                 {"module": "benchmarks.workloads", "type": "Images",
                  "config": {"size": 50_000 // scale}},
                 256, 512, {"module": "torch.optim", "type": "SGD",
                            "config": {"lr": 0.05, "momentum": 0.9, "nesterov": True}},
                 _STEP, epochs=3 if smoke else 4, precision="bf16", num_workers=4,
                 pin_memory=True, test_size=10_000 // scale),
    ]
    return {w.name: w for w in rows}


def ddp_workload(smoke: bool = False) -> Workload:
    """The 2-rank gloo row: a small MLP, global batch 32 in windows of 2 micro-batches,
    clipping, AdamW; ``handwritten_ddp.py`` is its hand-written side."""
    return Workload(
        "DDP 2 gloo ranks: MLP, global batch 32, 2-step windows, clip, AdamW", "cpu",
        {"module": "echelon3.nets.mlp", "type": "MLP",
         "config": {"in_features": 32, "hidden": 128, "depth": 3}},
        _blobs(512 if smoke else 20_480), 32, 256,
        {"module": "torch.optim", "type": "AdamW", "config": {"lr": 0.001,
                                                               "weight_decay": 0.01}},
        _STEP, epochs=3 if smoke else 4, test_size=256 if smoke else 2_048,
        trainer_extra={"grad_accum_steps": 2, "gradient_clip_val": 1.0}, nproc=2)


class StampedMLP(nn.Module):
    """echelon3's MLP that writes ``time.time()`` to ``$FIRST_STEP_FILE`` on its first
    training forward pass: how ``startup.py`` sees the first training step begin."""

    def __init__(self, **config):
        super().__init__()
        from echelon3.nets.mlp import MLP

        self.net = MLP(**config)
        self.stamped = False

    def forward(self, x):
        if self.training and not self.stamped:
            import os
            import time

            self.stamped = True
            with open(os.environ["FIRST_STEP_FILE"], "w") as f:
                f.write(repr(time.time()))
        return self.net(x)
