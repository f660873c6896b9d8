"""Small, fast runs for the training tests: a config written into a temporary
folder, the real CLI called in-process, and the files a run leaves read back.

The runs use scikit-learn's digits cut down with ``limit`` and a small MLP, so
one epoch takes a fraction of a second on a CPU.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from echelon3 import cli
from echelon3.checkpoints.files import CheckpointManager
from echelon3.distributed import runtime
from echelon3.distributed.precision import Precision

# Pin the CLI's log handler to pytest's own stderr, not to the stream of
# whichever test first runs the CLI (a capsys stream is closed after its test).
runtime.configure_logging()

TRAIN_LIMIT = 192
TEST_LIMIT = 96


def base_config(path: Path) -> dict[str, Any]:
    """A complete run: digits (cut down), an MLP with dropout, SGD, StepLR, 2 epochs."""
    return {
        "seed": 0,
        "device": "cpu",
        "net": {"module": "echelon3.nets.mlp", "type": "MLP",
                "config": {"hidden": 32, "dropout": 0.1}},
        "data": {
            "train": {"module": "echelon3.datasets.digits", "type": "Digits",
                      "config": {"split": "train", "limit": TRAIN_LIMIT}},
            "test": {"module": "echelon3.datasets.digits", "type": "Digits",
                     "config": {"split": "test", "limit": TEST_LIMIT}},
        },
        "dataloaders": {
            "train": {"module": "torch.utils.data", "type": "DataLoader",
                      "config": {"batch_size": 32, "shuffle": True, "drop_last": True}},
            "test": {"module": "torch.utils.data", "type": "DataLoader",
                     "config": {"batch_size": 64}},
        },
        "loss": [{"ce": {"module": "torch.nn", "type": "CrossEntropyLoss", "weight": 1.0}}],
        "metrics": [{"accuracy": {"module": "torchmetrics.classification",
                                  "type": "MulticlassAccuracy",
                                  "config": {"num_classes": 10, "average": "micro"}}}],
        "optimizer": {"module": "torch.optim", "type": "SGD",
                      "config": {"lr": 0.05, "momentum": 0.9}},
        "scheduler": {"module": "torch.optim.lr_scheduler", "type": "StepLR",
                      "config": {"step_size": 1, "gamma": 0.7}},
        "trainer": {"config": {"epochs": 2, "keep_best_on": "accuracy",
                               "progress_bar": False, "log_every_n_steps": 2}},
        "target": {"path": str(path), "checkpoints_to_keep": 2},
        "mlops": {"config": {"tensorboard": False}},
    }


def write_config(folder: Path, updates: dict | None = None, name: str = "run",
                 remove: tuple[str, ...] = ()) -> Path:
    """Write ``folder/<name>.yaml``: the base config with ``updates`` merged in.

    Mappings merge, lists and scalars replace; dotted keys in ``remove`` are deleted
    from the base first (to replace a mapping rather than merge into it).
    The run's ``target.path`` is ``folder/out`` unless ``updates`` says otherwise.
    """
    folder.mkdir(parents=True, exist_ok=True)
    cfg = OmegaConf.create(base_config(folder / "out"))
    for dotted in remove:
        *parents, last = dotted.split(".")
        node = cfg
        for part in parents:
            node = node[part]
        node.pop(last)
    cfg = OmegaConf.merge(cfg, OmegaConf.create(updates or {}))
    path = folder / f"{name}.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    return path


def echelon3(command: str, folder: Path, *overrides: str, name: str = "run") -> int:
    """``echelon3 <command> -cd folder -cn name overrides...`` in this process; the exit code."""
    return cli.main([command, "-cd", str(folder), "-cn", name, *overrides])


def target(folder: Path) -> Path:
    return folder / "out"


def without_clock(records: list[dict]) -> list[dict]:
    """``records`` without the wall clock, never equal between two runs: no ``time``
    records, and train records without their throughput."""
    from echelon3.trainers.throughput import CLOCK_KEYS

    return [{k: v for k, v in r.items() if k not in CLOCK_KEYS} for r in records
            if r["split"] != "time"]


def history(run_dir: Path, split: str | None = None) -> list[dict]:
    """The records of ``split``; without one, all but the ``time`` records, and train
    records without their throughput (:func:`without_clock`)."""
    records = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    if split is None:
        return without_clock(records)
    return [r for r in records if r["split"] == split]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_tensors(a: dict, b: dict) -> None:
    """Every entry of two state dicts is bit-for-bit equal."""
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def same_nested(a: Any, b: Any) -> bool:
    """Nested dicts / lists / tensors / numbers compare equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            same_nested(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(
            same_nested(x, y) for x, y in zip(a, b))
    return a == b


# --------------------------------------------------------------------------- direct Trainer runs

class RecordingLogger:
    """A logger that keeps every record in memory."""

    def __init__(self):
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        self.records.append(dict(record))

    def rewind(self, step: int) -> None:
        self.records = [r for r in self.records if r["step"] <= step]

    def close(self) -> None:
        pass

    def split(self, name: str) -> list[dict]:
        return [r for r in self.records if r["split"] == name]


def blobs(n: int = 64, seed: int = 0, classes: int = 3, features: int = 4):
    """A separable toy classification set: (inputs, labels)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    centres = torch.randn(classes, features, generator=g) * 3
    inputs = centres[labels] + 0.3 * torch.randn(n, features, generator=g)
    return inputs, labels


def loader(inputs, labels, batch_size: int = 16, shuffle: bool = False):
    dataset = torch.utils.data.TensorDataset(inputs, labels)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)


def make_trainer(tmp_path: Path, *, net=None, optimizer=None, losses=None, metrics=None,
                 test_loaders=None, train_loader=None, precision: str = "fp32", **settings):
    """A Trainer over toy data, built the way ``echelon3.tasks.train`` builds one."""
    import torchmetrics

    from echelon3.trainers.baseline import Trainer

    torch.manual_seed(0)
    inputs, labels = blobs()
    net = net if net is not None else torch.nn.Linear(4, 3)
    optimizer = optimizer(net.parameters()) if callable(optimizer) else (
        optimizer or torch.optim.SGD(net.parameters(), lr=0.1))
    settings.setdefault("progress_bar", False)
    return Trainer(
        net=net,
        losses=losses if losses is not None else {"ce": (torch.nn.CrossEntropyLoss(), 1.0)},
        optimizer=optimizer,
        train_loader=train_loader or loader(inputs, labels),
        test_loaders=test_loaders or {"test": loader(inputs, labels, 32)},
        metrics=metrics if metrics is not None else {
            "accuracy": torchmetrics.classification.MulticlassAccuracy(num_classes=3,
                                                                      average="micro")},
        checkpoints=CheckpointManager(tmp_path / "ckpt"),
        logger=RecordingLogger(),
        precision=Precision(precision, torch.device("cpu")),
        device=torch.device("cpu"),
        **settings,
    )


class ForwardCounter(torch.nn.Module):
    """Wraps a network and counts forward and backward passes."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net
        self.forwards = 0
        self.backwards = 0

    def forward(self, x):
        self.forwards += 1
        out = self.net(x)
        if out.requires_grad:
            out.register_hook(self._count_backward)
        return out

    def _count_backward(self, grad):
        self.backwards += 1
        return grad


@contextlib.contextmanager
def single_rank_group(folder: Path):
    """A one-rank gloo process group in this process (a file rendezvous: no port to
    collide on), so that DDP can wrap a network here."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
