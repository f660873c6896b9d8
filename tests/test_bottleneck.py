"""Where an epoch's time went: the ``time`` records, the log lines and the lever."""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch

from echelon3.observe.bottleneck import INPUT_BOUND, EpochClock
from tests.helpers import blobs, make_trainer

FRACTIONS = ("data_wait", "train_step", "overhead", "validation_checkpoint")


class SlowSet(torch.utils.data.Dataset):
    """Blobs whose every sample takes ``delay`` seconds to load."""

    def __init__(self, delay: float):
        self.inputs, self.labels = blobs()
        self.delay = delay

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        time.sleep(self.delay)
        return self.inputs[index], self.labels[index]


def _time_records(trainer) -> list[dict]:
    return trainer.logger.split("time")


def test_every_epoch_records_where_its_time_went(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="echelon3")
    trainer = make_trainer(tmp_path, epochs=3)
    trainer.fit()
    records = _time_records(trainer)
    assert [(r["epoch"], r["step"]) for r in records] == [(1, 4), (2, 8), (3, 12)]
    for r in records:
        assert r["steps"] == 4 and r["epoch_s"] > 0 and r["batch_ms"] > 0
        assert all(0.0 <= r[k] <= 1.0 for k in FRACTIONS)
        assert math.isclose(sum(r[k] for k in FRACTIONS), 1.0, abs_tol=1e-9)
        assert "device_util" not in r and "device_batch_ms" not in r  # CPU: no device clock
    # The log says it once, after the first steady-state epoch (epoch 2).
    said = [m for m in caplog.messages if m.startswith("where the time went")]
    assert len(said) == 1 and said[0].startswith("where the time went in epoch 2 ("), said


def test_time_records_do_not_change_the_train_and_val_records(tmp_path):
    trainer = make_trainer(tmp_path, epochs=2, log_every_n_steps=1)
    trainer.fit()
    splits = [r["split"] for r in trainer.logger.records]
    assert splits == ["train"] * 4 + ["val", "time"] + ["train"] * 4 + ["val", "time"]


def test_a_slow_dataset_is_named_input_bound_with_the_loader_lever(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="echelon3")
    slow = torch.utils.data.DataLoader(SlowSet(0.004), batch_size=16)
    trainer = make_trainer(tmp_path, epochs=2, train_loader=slow)
    trainer.fit()
    assert _time_records(trainer)[-1]["data_wait"] >= INPUT_BOUND
    levers = [m for m in caplog.messages if m.startswith("input-bound")]
    assert len(levers) == 1, caplog.messages
    assert "dataloaders.train.config.num_workers (now 0)" in levers[0]


def test_a_fast_loader_is_not_called_input_bound(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="echelon3")
    make_trainer(tmp_path, epochs=2).fit()
    assert not [m for m in caplog.messages if m.startswith("input-bound")]


@pytest.mark.parametrize("report, cuda, expected", [
    ({"data_wait": 0.6, "train_step": 0.3, "batch_ms": 5.0}, True, "pin_memory: true"),
    ({"data_wait": 0.05, "train_step": 0.9, "batch_ms": 0.3, "device_util": 0.2}, True,
     "compile: true"),
    ({"data_wait": 0.05, "train_step": 0.9, "batch_ms": 0.3}, False, "compile: true"),
    ({"data_wait": 0.05, "train_step": 0.9, "batch_ms": 40.0}, False, None),
    ({"data_wait": 0.05, "train_step": 0.9, "batch_ms": 0.3, "device_util": 0.95}, True, None),
])
def test_the_lever_names_one_setting_only_when_the_limit_is_clear(report, cuda, expected):
    clock = EpochClock(torch.device("cpu"))
    clock.cuda = cuda  # the rule, without a GPU
    lever = clock.lever(report)
    assert (lever is None) if expected is None else (expected in lever)


def test_a_compiled_net_compiles_in_epoch_1_only(tmp_path, caplog):
    """Validation (eval mode, no grad) and the last, smaller batch compile during warm-up;
    later epochs reuse those graphs. The eager backend keeps the test fast."""
    caplog.set_level(logging.INFO, logger="echelon3")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    inputs, labels = blobs(60)
    uneven = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels),
                                         batch_size=16)  # 16, 16, 16, 12
    trainer = make_trainer(tmp_path, net=torch.compile(net, backend="eager"), epochs=3,
                           train_loader=uneven)
    trainer.fit()
    compiles = [r["compiles"] for r in _time_records(trainer)]
    assert compiles[0] >= 1 and compiles[1:] == [0, 0], compiles
    assert not [m for m in caplog.messages if "recompiled" in m]
