"""echelon3.config.preflight: every component, trainer included, checked before anything is
built."""

from __future__ import annotations

import pytest

from echelon3.config import preflight
from echelon3.config.errors import BuildError
from echelon3.tasks import components
from tests.helpers import echelon3, target, write_config


def cfg_with(tmp_path, override):
    from echelon3.config.compose import load_config

    write_config(tmp_path)
    return load_config(tmp_path, "run", [override]).cfg


@pytest.mark.parametrize("override, message", [
    ("trainer.config.epochs=abc", "trainer.config.epochs: expected an integer or null, got 'abc'"),
    ("optimizer.config.lr=abc", "optimizer.config.lr: expected a number or a Tensor, got 'abc'"),
    ("dataloaders.train.config.batch_size=big",
     "dataloaders.train.config.batch_size: expected an integer or null, got 'big'"),
    ("target.checkpoints_to_keep=two", "target.checkpoints_to_keep: expected an integer"),
    ("metrics.0.accuracy.config.average=mean", "metrics.accuracy.config.average: expected one of"),
    ("mlops.config.tensorboard=maybe", "mlops.config.tensorboard: expected true or false"),
    ("trainer.config.epocs=3", "trainer.config.epocs: Trainer does not accept 'epocs' (did you "
                               "mean 'epochs'?); it accepts: epochs,"),
])
def test_the_pre_flight_checks_every_component_trainer_included(tmp_path, override, message):
    cfg = cfg_with(tmp_path, override)
    with pytest.raises(BuildError) as caught:
        preflight.check_specs(cfg, tmp_path, skip=("evaluator", "runner"),
                          consumed={"trainer": ("precision",)})
    assert str(caught.value).startswith(message), str(caught.value)


def test_a_bad_trainer_argument_stops_train_before_data_or_model_is_built(
        tmp_path, monkeypatch, capsys):
    built = []
    monkeypatch.setattr(components, "build_net", lambda *a, **k: built.append("net"))
    monkeypatch.setattr(components, "build_datasets", lambda *a, **k: built.append("data"))
    write_config(tmp_path)
    assert echelon3("train", tmp_path, "trainer.config.epochs=abc") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "echelon3: error: trainer.config.epochs: expected an integer or null, got 'abc'"
    assert built == [] and not (target(tmp_path) / "config.yaml").exists()


def test_a_null_scheduler_drops_the_inherited_one(tmp_path):
    cfg = cfg_with(tmp_path, "scheduler=null")
    assert cfg.scheduler is None
    preflight.check_specs(cfg, tmp_path, skip=("evaluator", "runner"))  # no TypeError
