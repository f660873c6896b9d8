"""init_from and finetune: partial loads, freezing, per-group learning rates, resume, identity.

The parent is the shared ``trained`` run (digits MLP, hidden 32); children are
one-epoch runs of the same config started from its best.tar.
"""

from __future__ import annotations

import logging

import pytest
import torch
from omegaconf import OmegaConf

from echelon3.config.errors import CheckpointError, ConfigError
from echelon3.nets.mlp import MLP
from echelon3.tasks.finetune import WarmStart, load_partial, weights_hash
from tests.helpers import assert_same_tensors, echelon3, load, write_config

FIRST = r"^layers\.1\."  # the MLP's first Linear
LAST = r"^layers\.4\."  # its output Linear (depth 2)


def child(folder, parent, **updates):
    """A one-epoch finetune of ``parent``'s best.tar in ``folder``."""
    cfg = {"init_from": {"checkpoint": str(parent / "out" / "best.tar")},
           "trainer": {"config": {"epochs": 1}}}
    for key, value in updates.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return write_config(folder, cfg)


def test_partial_load_loads_what_fits_and_reports_it_in_one_line(caplog):
    torch.manual_seed(0)
    parent = MLP(hidden=32)
    state = {f"module.{k}": v for k, v in parent.state_dict().items()}  # a DDP-era prefix
    torch.manual_seed(1)
    deeper = MLP(hidden=32, depth=3)  # layers.1 fits; layers.4 is 32x32 now; layers.7 new
    before = {k: v.clone() for k, v in deeper.state_dict().items()}
    from echelon3.checkpoints.files import strip_prefixes

    with caplog.at_level(logging.INFO, logger="echelon3.tasks.finetune"):
        names = load_partial(deeper, strip_prefixes(state), "parent.tar", strict=False)
    assert names == {"loaded": ["layers.1.weight", "layers.1.bias"],
                     "skipped": ["layers.4.weight", "layers.4.bias"],
                     "missing": ["layers.7.weight", "layers.7.bias"]}
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["init_from parent.tar: loaded 2 tensors, skipped 2 (layers.4.weight, "
                     "layers.4.bias), missing 2 (layers.7.weight, layers.7.bias)"]
    now = deeper.state_dict()
    assert torch.equal(now["layers.1.weight"], parent.layers[1].weight)
    for key in ("layers.4.weight", "layers.7.bias"):
        assert torch.equal(now[key], before[key])
    with pytest.raises(CheckpointError, match="init_from.checkpoint: parent.tar does not fit "
                                              "the network: 'layers.4.weight' has another shape"):
        load_partial(MLP(hidden=32, depth=3), strip_prefixes(state), "parent.tar", strict=True)


def test_freezing_and_param_groups(tmp_path, trained):
    folder = tmp_path / "ft"
    child(folder, trained, finetune={"freeze_patterns": [FIRST],
                                     "param_groups": [{"pattern": LAST, "lr_mult": 10.0}]},
          net={"config": {"dropout": 0.0}})
    assert echelon3("finetune", folder) == 0
    parent = load(trained / "out" / "best.tar")["model_state_dict"]
    state = load(folder / "out" / "checkpoint-1.tar")
    weights = state["model_state_dict"]
    for key in ("layers.1.weight", "layers.1.bias"):  # frozen: the parent's values
        assert torch.equal(weights[key], parent[key]), key
    assert not torch.equal(weights["layers.4.weight"], parent["layers.4.weight"])
    groups = state["optimizer_state_dict"]["param_groups"]
    assert [len(g["params"]) for g in groups] == [2]  # frozen ones are not in the optimizer
    assert groups[0]["lr_mult"] == 10.0
    assert groups[0]["lr"] == pytest.approx(0.05 * 10.0 * 0.7)  # optimizer lr x mult, StepLR


def test_param_groups_split_trainable_parameters(tmp_path):
    from echelon3.tasks.finetune import scale_group_lrs

    cfg = OmegaConf.create({"finetune": {"param_groups": [{"pattern": LAST, "lr_mult": 0.5}]}})
    net = MLP(hidden=8)
    groups = WarmStart(cfg).apply(net)
    optimizer = torch.optim.SGD(groups, lr=0.2)
    scale_group_lrs(optimizer)
    assert [(len(g["params"]), g["lr"]) for g in optimizer.param_groups] == [(2, 0.1), (2, 0.2)]
    assert optimizer.param_groups[0]["params"][0] is net.layers[4].weight


@pytest.mark.parametrize("section,key", [
    ({"freeze_patterns": [FIRST, "^nothing"]}, "finetune.freeze_patterns[1]"),
    ({"param_groups": [{"pattern": "^nothing", "lr_mult": 2}]}, "finetune.param_groups[0].pattern"),
    ({"freeze_patterns": ["(unclosed"]}, "finetune.freeze_patterns[0]"),
    ({"param_groups": [{"pattern": LAST, "lr_mult": "x"}]}, "finetune.param_groups[0].lr_mult"),
    ({"freeze": [FIRST]}, "finetune.freeze"),
])
def test_bad_finetune_settings_name_the_key(section, key):
    cfg = OmegaConf.create({"finetune": section})
    with pytest.raises(ConfigError, match=rf"^{key.replace('[', '.').replace(']', '.')}"):
        WarmStart(cfg).apply(MLP(hidden=8))


def test_a_pattern_matching_nothing_fails_the_cli_in_one_line(tmp_path, trained, capsys):
    folder = tmp_path / "ft"
    child(folder, trained, finetune={"freeze_patterns": ["^encoder\\."]})
    assert echelon3("finetune", folder) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("echelon3: error: finetune.freeze_patterns[0]: '^encoder\\.' matches "
                          "no parameter; parameters are: layers.1.weight") and "\n" not in err
    assert not (folder / "out" / "checkpoint-1.tar").exists()


def test_finetune_requires_init_from(tmp_path, capsys):
    write_config(tmp_path)
    assert echelon3("finetune", tmp_path) == 2
    assert "init_from: required section missing for 'finetune'" in capsys.readouterr().err


def test_finetune_resumes_and_new_parent_weights_make_a_new_run(tmp_path, trained, capsys):
    straight, split = tmp_path / "straight", tmp_path / "split"
    for folder in (straight, split):
        child(folder, trained, finetune={"freeze_patterns": [FIRST]})
    assert echelon3("finetune", straight, "trainer.config.epochs=2") == 0
    assert echelon3("finetune", split) == 0
    assert echelon3("finetune", split, "trainer.config.epochs=2") == 0
    assert "Resuming from" in capsys.readouterr().err
    assert_same_tensors(load(split / "out" / "checkpoint-2.tar")["model_state_dict"],
                        load(straight / "out" / "checkpoint-2.tar")["model_state_dict"])

    parent = load(trained / "out" / "best.tar")
    parent["model_state_dict"] = {k: v + 1 for k, v in parent["model_state_dict"].items()}
    torch.save(parent, tmp_path / "retrained.tar")
    assert weights_hash(parent["model_state_dict"]) != weights_hash(
        load(trained / "out" / "best.tar")["model_state_dict"])
    assert echelon3("finetune", split, "trainer.config.epochs=3",
                    f"init_from.checkpoint={tmp_path / 'retrained.tar'}") == 2
    assert "holds checkpoints of a different config" in capsys.readouterr().err


# --------------------------------------------------------------------------- the parent's split


def test_a_child_of_a_run_that_trained_on_all_of_data_train_cannot_carve_a_split(
        tmp_path, trained, capsys):
    child(tmp_path, trained, data={"val_split": 0.2})
    assert echelon3("train", tmp_path) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("echelon3: error: data.val_split: every sample of data.train "
                           f"trained the run init_from starts from ({trained / 'out'}"), last


def test_a_seed_sweep_child_validates_on_its_parents_unseen_samples(tmp_path, caplog):
    """Parent: seed 0, val_split 0.2. Child: seed 1 (as a seed sweep writes it). The
    child's validation samples are the parent's, none of which the parent trained on."""
    from echelon3.data import splits
    from echelon3.datasets.digits import Digits
    from tests.helpers import TRAIN_LIMIT

    parent = tmp_path / "parent"
    write_config(parent, {"data": {"val_split": 0.2}, "trainer": {"config": {"epochs": 1}}})
    assert echelon3("train", parent) == 0
    folder = tmp_path / "child"
    write_config(folder, {"seed": 1, "data": {"val_split": 0.2},
                          "init_from": {"checkpoint": str(parent / "out" / "best.tar")},
                          "trainer": {"config": {"epochs": 1}}})
    with caplog.at_level(logging.INFO, logger="echelon3.data.splits"):
        assert echelon3("train", folder) == 0
    assert any("validating on the samples init_from's run" in r.getMessage()
               for r in caplog.records)
    record = load(folder / "out" / "best.tar")[splits.RECORD]
    assert record == load(parent / "out" / "best.tar")[splits.RECORD]
    assert (record["val_split"], record["seed"]) == (0.2, 0)
    # by index: what the child validates on is what the parent set aside
    cfg = OmegaConf.load(folder / "run.yaml")
    data = Digits(split="train", limit=TRAIN_LIMIT)
    parent_train, parent_val = splits.carve(data, 0.2, 0)
    value, seed = splits.for_child(cfg.data, 1, record, "parent")
    _, child_val = splits.carve(data, value, seed)
    assert child_val.indices == parent_val.indices
    assert not set(child_val.indices) & set(parent_train.indices)
    _, own_draw = splits.carve(data, 0.2, 1)  # what the child would have drawn alone
    assert set(own_draw.indices) & set(parent_train.indices)
