"""echelon3.arguments: keyword names and value types checked against a signature,
and the pre-flight that checks every component before anything is built."""

from __future__ import annotations

from typing import Literal, Optional, Sequence, Union

import pytest
import torch

from echelon3 import build
from echelon3.arguments import check_arguments
from echelon3.errors import BuildError
from tests.helpers import echelon3, target, write_config


class Component:
    def __init__(self, count: int = 1, rate: Union[float, torch.Tensor] = 0.1,
                 mode: Literal["a", "b"] = "a", name: Optional[str] = None,
                 sizes: tuple[int, int] = (1, 2), sets: str | Sequence[str] | None = None,
                 flag: bool = False, untyped=3, anything=None):
        pass


@pytest.mark.parametrize("kwargs", [
    {"count": 3, "rate": 1, "mode": "b", "name": None, "sizes": [3, 4], "sets": ["x"],
     "flag": True, "untyped": 0.5, "anything": {"k": 1}},
    {"rate": torch.tensor(0.1), "sets": "x", "name": "n"},
])
def test_values_that_fit_pass(kwargs):
    check_arguments(Component, kwargs, "part")


@pytest.mark.parametrize("kwargs, message", [
    ({"count": "abc"}, "part.config.count: expected an integer, got 'abc'"),
    ({"count": 2.5}, "part.config.count: expected an integer, got 2.5"),
    ({"count": True}, "part.config.count: expected an integer, got True"),
    ({"rate": "abc"}, "part.config.rate: expected a number or a Tensor, got 'abc'"),
    ({"mode": "c"}, "part.config.mode: expected one of 'a', 'b', got 'c'"),
    ({"name": 3}, "part.config.name: expected a string or null, got 3"),
    ({"flag": "yes"}, "part.config.flag: expected true or false, got 'yes'"),
    ({"untyped": "x"}, "part.config.untyped: expected a number, got 'x'"),
    ({"coutn": 1}, "part.config.coutn: Component does not accept 'coutn' (did you mean "
                   "'count'?)"),
])
def test_a_value_of_the_wrong_type_names_the_key_and_what_was_expected(kwargs, message):
    with pytest.raises(BuildError) as caught:
        check_arguments(Component, kwargs, "part")
    assert str(caught.value).startswith(message), str(caught.value)


def cfg_with(tmp_path, override):
    from echelon3.config import load_config

    write_config(tmp_path)
    return load_config(tmp_path, "run", [override]).cfg


@pytest.mark.parametrize("override, message", [
    ("trainer.config.epochs=abc", "trainer.config.epochs: expected an integer, got 'abc'"),
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
        build.check_specs(cfg, tmp_path, skip=("evaluator", "runner"),
                          consumed={"trainer": ("precision",)})
    assert str(caught.value).startswith(message), str(caught.value)


def test_a_bad_trainer_argument_stops_train_before_data_or_model_is_built(
        tmp_path, monkeypatch, capsys):
    built = []
    monkeypatch.setattr(build, "build_net", lambda *a, **k: built.append("net"))
    monkeypatch.setattr(build, "build_datasets", lambda *a, **k: built.append("data"))
    write_config(tmp_path)
    assert echelon3("train", tmp_path, "trainer.config.epochs=abc") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "echelon3: error: trainer.config.epochs: expected an integer, got 'abc'"
    assert built == [] and not (target(tmp_path) / "config.yaml").exists()
