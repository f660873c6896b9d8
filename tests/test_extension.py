"""Extending a run whose learning-rate schedule has a length: refused with the two ways
on, unless ``trainer.config.extend: keep_schedule`` accepts the old schedule."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from echelon3.checkpoints import extension
from tests.helpers import echelon3, history, load, target, write_config

COSINE = {"scheduler": {"module": "torch.optim.lr_scheduler", "type": "CosineAnnealingLR",
                        "config": {"T_max": 2}}}
LR = 0.05


def _files(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


@pytest.fixture
def cosine_run(tmp_path):
    """A finished 2-epoch run on a cosine schedule of 2 epochs."""
    write_config(tmp_path, COSINE, remove=("scheduler",))
    assert echelon3("train", tmp_path) == 0
    assert load(target(tmp_path) / "checkpoint-2.tar")["epochs"] == 2
    return tmp_path


def test_more_epochs_on_a_schedule_with_a_length_are_refused(cosine_run, capsys):
    before = _files(target(cosine_run))
    capsys.readouterr()
    assert echelon3("train", cosine_run, "trainer.config.epochs=4") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "echelon3: error: trainer.config.epochs: changed from 2 to 4 on resume, but the "
        "learning-rate schedule's length (scheduler.config.T_max) was set for the old run and "
        "a resumed scheduler keeps it; start a new run from this one's weights (init_from, "
        "another target.path), or set trainer.config.extend=keep_schedule to continue on "
        "the old schedule")
    assert _files(target(cosine_run)) == before  # nothing written, nothing moved


def test_keep_schedule_continues_on_the_old_schedule(cosine_run):
    assert echelon3("train", cosine_run, "trainer.config.epochs=4",
                    "+trainer.config.extend=keep_schedule") == 0
    out = target(cosine_run)
    assert load(out / "checkpoint-4.tar")["epochs"] == 4  # the next resume compares to 4
    # CosineAnnealingLR's closed form with T_max 2, stepped once per epoch: the lr of
    # epoch e (1-based) is lr(e - 1); past T_max it climbs back (the old schedule, kept)
    lrs = {r["epoch"]: r["lr"] for r in history(out, "train")}
    for epoch in (1, 2, 3, 4):
        step = epoch - 1
        expected = LR * (1 + math.cos(math.pi * step / 2)) / 2
        assert lrs[epoch] == pytest.approx(expected, abs=1e-9), epoch
    # with the new number recorded, a later resume at 4 epochs needs nothing
    assert echelon3("train", cosine_run, "trainer.config.epochs=4") == 0


def test_a_schedule_without_a_length_extends_freely(tmp_path):
    write_config(tmp_path)  # StepLR: no length
    assert echelon3("train", tmp_path, "trainer.config.epochs=1") == 0
    assert echelon3("train", tmp_path, "trainer.config.epochs=2") == 0
    assert load(target(tmp_path) / "checkpoint-2.tar")["epoch"] == 2


def test_a_bad_extend_value_names_the_key(tmp_path, capsys):
    write_config(tmp_path)
    assert echelon3("train", tmp_path, "+trainer.config.extend=restart") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "echelon3: error: trainer.config.extend: must be null or keep_schedule, got 'restart'")


@pytest.mark.parametrize("scheduler, found", [
    ({"type": "CosineAnnealingLR", "config": {"T_max": 10}}, ["scheduler.config.T_max"]),
    ({"type": "OneCycleLR", "config": {"max_lr": 0.1, "epochs": 10, "steps_per_epoch": 5}},
     ["scheduler.config.epochs"]),
    ({"type": "OneCycleLR", "config": {"max_lr": 0.1, "total_steps": 50}},
     ["scheduler.config.total_steps"]),
    ({"type": "LinearLR", "config": {"total_iters": 5}}, ["scheduler.config.total_iters"]),
    ({"type": "PolynomialLR", "config": {"total_iters": 5, "power": 2.0}},
     ["scheduler.config.total_iters"]),
    ({"type": "LambdaLR", "config": {"lr_lambda": "${trainer.config.epochs}"}},
     ["scheduler.config.lr_lambda (${trainer.config.epochs})"]),
    ({"type": "SequentialLR", "config": {"milestones": [2], "schedulers": [
        {"module": "torch.optim.lr_scheduler", "type": "LinearLR",
         "config": {"total_iters": 2}},
        {"module": "torch.optim.lr_scheduler", "type": "StepLR", "config": {"step_size": 1}}]}},
     ["scheduler.config.schedulers[0].config.total_iters"]),
    ({"type": "StepLR", "config": {"step_size": 5}}, []),
    ({"type": "CosineAnnealingWarmRestarts", "config": {"T_0": 5}}, []),
])
def test_which_schedules_have_a_length(scheduler, found):
    cfg = OmegaConf.create({"trainer": {"config": {"epochs": 10}}, "scheduler": {
        "module": "torch.optim.lr_scheduler", **scheduler}})
    assert extension.schedule_lengths(cfg) == found


def test_a_length_interpolated_from_epochs_is_refused_even_when_resuming_anyway(tmp_path,
                                                                                capsys):
    """T_max: ${trainer.config.epochs} changes the config's fingerprint; a resume forced
    with on_config_change=resume would still keep the old T_max, so it is refused too."""
    write_config(tmp_path, {"scheduler": {**COSINE["scheduler"],
                                          "config": {"T_max": "${trainer.config.epochs}"}}},
                 remove=("scheduler",))
    assert echelon3("train", tmp_path, "trainer.config.epochs=1") == 0
    capsys.readouterr()
    assert echelon3("train", tmp_path, "trainer.config.epochs=2", "on_config_change=resume") == 2
    assert "trainer.config.epochs: changed from 1 to 2 on resume" in capsys.readouterr().err


def test_finetune_accepts_the_keys_train_reads_itself(tmp_path, cosine_run):
    """finetune is train from other weights: extend (and tf32, ...) pass its pre-flight."""
    write_config(tmp_path / "child", {
        **COSINE, "init_from": {"checkpoint": str(target(cosine_run) / "best.tar")},
        "trainer": {"config": {"epochs": 1, "extend": "keep_schedule", "tf32": False}}},
        remove=("scheduler",))
    assert echelon3("finetune", tmp_path / "child") == 0
