"""Shared fixtures: the real console scripts, and small run configs written to tmp_path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROBE = Path(__file__).resolve().parent / "probe.py"


def echelon3_cmd() -> list[str]:
    exe = BIN / "echelon3"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "echelon3"]


def run_cli(args, cwd=None, env=None, timeout=180) -> subprocess.CompletedProcess:
    """Run the real ``echelon3`` console script; output captured as text."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("RANK", None)
    return subprocess.run([*echelon3_cmd(), *args], cwd=cwd, env=full_env, text=True,
                          capture_output=True, timeout=timeout)


def probe_config(directory: Path, name: str = "probe", *, train_size: int = 64,
                 test_size: int = 101, batch: int = 8, epochs: int = 2, net: dict | None = None,
                 metrics: list | None = None, extra: dict | None = None) -> Path:
    """A tiny run on IndexDataset/ProbeNet that trains in a second."""
    cfg = {
        "seed": 0,
        "device": "cpu",
        "net": {"module": str(PROBE), "type": "ProbeNet",
                "config": {"log_dir": str(directory / "probe"), **(net or {})}},
        "data": {
            "train": {"module": str(PROBE), "type": "IndexDataset", "config": {"size": train_size}},
            "test": {"module": str(PROBE), "type": "IndexDataset",
                     "config": {"size": test_size, "seed": 1}},
        },
        "dataloaders": {
            "train": {"module": "torch.utils.data", "type": "DataLoader",
                      "config": {"batch_size": batch, "shuffle": True, "drop_last": True}},
            "test": {"module": "torch.utils.data", "type": "DataLoader",
                     "config": {"batch_size": 10}},
        },
        "loss": [{"ce": {"module": "torch.nn", "type": "CrossEntropyLoss", "weight": 1.0}}],
        "metrics": metrics if metrics is not None else [
            {"accuracy": {"module": "torchmetrics.classification", "type": "MulticlassAccuracy",
                          "config": {"num_classes": 2, "average": "micro"}}},
            {"counted": {"module": str(PROBE), "type": "CountingAccuracy"}},
            {"seen": {"module": str(PROBE), "type": "SeenSamples"}},
        ],
        "optimizer": {"module": "torch.optim", "type": "SGD", "config": {"lr": 0.1}},
        "trainer": {"config": {"epochs": epochs, "precision": "fp32"}},
        "target": {"path": str(directory / "run"), "checkpoints_to_keep": 3},
    }
    for key, value in (extra or {}).items():
        cfg[key] = value
    (directory / "probe").mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def edit_yaml(path: Path, change) -> None:
    """Load ``path``, let ``change(cfg)`` modify the dict, write it back."""
    cfg = yaml.safe_load(path.read_text())
    change(cfg)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-epoch run of tests.helpers' config: checkpoints and best.tar. Read-only."""
    from tests.helpers import echelon3, write_config

    folder = tmp_path_factory.mktemp("trained")
    write_config(folder)
    assert echelon3("train", folder) == 0
    return folder


@pytest.fixture
def probe(tmp_path):
    """(config dir, writer): call writer(**kwargs) to (re)write probe.yaml."""
    return tmp_path, lambda **kw: probe_config(tmp_path, **kw)


from tests.slurm.cluster import (  # noqa: E402,F401  (session fixtures: a real local SLURM)
    slurm_cluster, slurm_two_nodes)


def pytest_collection_modifyitems(config, items):
    """GPU-only tests run where CUDA is; elsewhere they are skipped with the reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none "
                                   "(benchmarks/gpu_check.py covers the same on a GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def own_handlers():
    """In-process runs install echelon3's signal handlers; put pytest's back afterwards."""
    import signal

    from echelon3.distributed import preemption

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    preemption.reset()
