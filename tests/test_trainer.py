"""The training loop: steps, losses, closure optimizers, keep-best, named test
sets, seeds, label handling, and the files and logs a run leaves."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import yaml

from echelon3.config.errors import ConfigError
from echelon3.data.batches import match_target, weighted_loss
from echelon3.observe.loggers import NoOpLogger
from echelon3.trainers.selection import KeepBest
from tests.helpers import (ForwardCounter, assert_same_tensors, blobs, echelon3, history, load,
                           loader, make_trainer, target, write_config)

STEPS_PER_EPOCH = 6  # 192 training samples, batch 32, drop_last


# --------------------------------------------------------------------------- the step


def test_weighted_loss_is_the_weighted_sum_of_the_parts():
    pred, labels = torch.randn(8, 3), torch.randint(0, 3, (8,))
    ce, margin = torch.nn.CrossEntropyLoss(), torch.nn.MultiMarginLoss()
    total, parts = weighted_loss({"ce": (ce, 0.25), "margin": (margin, 3.0)}, pred, labels)
    assert torch.allclose(parts["ce"], ce(pred, labels))
    assert torch.allclose(parts["margin"], margin(pred, labels))
    assert torch.allclose(total, 0.25 * ce(pred, labels) + 3.0 * margin(pred, labels))


def test_each_step_zeroes_grads_then_steps_on_the_fresh_gradient(tmp_path):
    """Two SGD steps of the trainer equal two manual steps (stale grads would differ)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    manual = torch.nn.Linear(4, 3)
    manual.load_state_dict(net.state_dict())
    trainer = make_trainer(tmp_path, net=net,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.5), epochs=1)
    inputs, labels = blobs()
    batches = [(inputs[:16], labels[:16]), (inputs[16:32], labels[16:32])]
    for batch in batches:
        trainer.micro_batch(batch, 1.0, True)
    for x, y in batches:
        manual.zero_grad()
        torch.nn.functional.cross_entropy(manual(x), y).backward()
        with torch.no_grad():
            for p in manual.parameters():
                p -= 0.5 * p.grad
    for a, b in zip(net.parameters(), manual.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_plain_optimizer_does_one_forward_and_backward_per_step(tmp_path):
    net = ForwardCounter(torch.nn.Linear(4, 3))
    trainer = make_trainer(tmp_path, net=net, epochs=1)
    trainer.micro_batch(next(iter(trainer.train_loader)), 1.0, True)
    assert (net.forwards, net.backwards) == (1, 1)


def test_lbfgs_is_stepped_with_a_closure(tmp_path):
    net = ForwardCounter(torch.nn.Linear(4, 3))
    trainer = make_trainer(tmp_path, net=net, epochs=1,
                           optimizer=lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=5))
    assert trainer.closure
    batch = next(iter(trainer.train_loader))
    before = torch.nn.functional.cross_entropy(net.net(batch[0]), batch[1]).item()
    parts = trainer.closure_step(batch)
    after = torch.nn.functional.cross_entropy(net.net(batch[0]), batch[1]).item()
    assert net.backwards > 1  # LBFGS re-evaluates the closure within one step
    assert after < before
    # What the step reports is the loss at the start of the step, not a later evaluation.
    assert math.isclose(parts["loss"].item(), before, rel_tol=1e-5)


def test_trailing_singleton_dims_are_squeezed_and_float_labels_cast():
    pred, labels = torch.randn(5, 1, 1), torch.tensor([0, 1, 1, 0, 1])
    squeezed, same = match_target(pred, labels)
    assert squeezed.shape == (5,) and same.dtype == torch.int64
    _, floats = match_target(pred, labels, float_labels=True)
    assert floats.dtype == torch.float32 and torch.equal(floats, labels.float())
    # A class dimension is not a singleton and stays.
    logits, _ = match_target(torch.randn(5, 10), labels)
    assert logits.shape == (5, 10)


BINARY_DIGITS = '''
from echelon3.datasets.digits import Digits


class EvenOdd(Digits):
    """Digits with label 1 for odd digits, 0 for even ones (an int64 label)."""

    def __getitem__(self, index):
        image, label = super().__getitem__(index)
        return image, label % 2
'''


def test_float_labels_and_a_single_output_train_with_bce(tmp_path):
    (tmp_path / "evenodd.py").write_text(BINARY_DIGITS)
    data = {split: {"module": "evenodd.py", "type": "EvenOdd",
                    "config": {"split": split, "limit": lim}}
            for split, lim in (("train", 192), ("test", 96))}
    write_config(tmp_path, {
        "net": {"config": {"num_classes": 1}},  # predictions (B, 1) against labels (B,)
        "data": data,
        "loss": [{"bce": {"module": "torch.nn", "type": "BCEWithLogitsLoss"}}],
        "metrics": [{"accuracy": {"module": "torchmetrics.classification",
                                  "type": "BinaryAccuracy"}}],
        "trainer": {"config": {"float_labels": True, "epochs": 3}},
    })
    assert echelon3("train", tmp_path) == 0
    val = history(target(tmp_path), "val")
    assert len(val) == 3 and val[-1]["accuracy"] > 0.6
    # evaluate treats the labels as the trainer did
    assert echelon3("evaluate", tmp_path) == 0
    metrics = json.loads((target(tmp_path) / "metrics.json").read_text())
    best = max(val, key=lambda r: r["accuracy"])
    assert metrics.pop("selected_on") == "test"  # no validation data: the test set chose
    assert metrics == {"loss": pytest.approx(best["loss"]),
                       "accuracy": pytest.approx(best["accuracy"])}


def test_without_float_labels_bce_on_integer_labels_fails(tmp_path, capsys):
    (tmp_path / "evenodd.py").write_text(BINARY_DIGITS)
    data = {split: {"module": "evenodd.py", "type": "EvenOdd", "config": {"split": split,
                                                                          "limit": 64}}
            for split in ("train", "test")}
    write_config(tmp_path, {"net": {"config": {"num_classes": 1}}, "data": data,
                            "loss": [{"bce": {"module": "torch.nn",
                                              "type": "BCEWithLogitsLoss"}}],
                            "metrics": [], "trainer": {"config": {"keep_best_on": None}}})
    assert echelon3("train", tmp_path) == 1  # torch's traceback, then the key whose code raised
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("echelon3: error: loss.bce: RuntimeError: ") and \
        last.endswith("(during training)"), last


# --------------------------------------------------------------------------- losses via the CLI


def test_configured_losses_are_summed_with_their_weights(tmp_path):
    write_config(tmp_path, {
        "loss": [{"ce": {"module": "torch.nn", "type": "CrossEntropyLoss", "weight": 0.5}},
                 {"margin": {"module": "torch.nn", "type": "MultiMarginLoss", "weight": 2.0}}],
        "trainer": {"config": {"epochs": 1, "log_every_n_steps": 1}},
    })
    assert echelon3("train", tmp_path) == 0
    train = history(target(tmp_path), "train")
    assert len(train) == STEPS_PER_EPOCH
    for record in train:
        assert math.isclose(record["loss"], 0.5 * record["ce"] + 2.0 * record["margin"],
                            rel_tol=1e-5)
        assert record["ce"] != record["margin"]


def test_loss_named_like_a_history_field_is_rejected(tmp_path, capsys):
    write_config(tmp_path, {"loss": [{"loss": {"module": "torch.nn",
                                               "type": "CrossEntropyLoss"}}]})
    assert echelon3("train", tmp_path) == 2
    assert "loss.loss" in capsys.readouterr().err
    assert not (target(tmp_path) / "checkpoint-1.tar").exists()


def test_lbfgs_from_the_config_trains(tmp_path):
    write_config(tmp_path, {
        "optimizer": {"module": "torch.optim", "type": "LBFGS",
                      "config": {"lr": 0.5, "max_iter": 4}},
        "trainer": {"config": {"epochs": 1}},
    }, remove=("scheduler", "optimizer"))
    assert echelon3("train", tmp_path) == 0
    val = history(target(tmp_path), "val")
    assert val[-1]["accuracy"] > 0.5
    assert "state" in load(target(tmp_path) / "checkpoint-1.tar")["optimizer_state_dict"]


def test_scheduler_steps_once_per_epoch(tmp_path):
    write_config(tmp_path, {"trainer": {"config": {"epochs": 3}}})  # StepLR(1, gamma 0.7)
    assert echelon3("train", tmp_path) == 0
    by_epoch = {}
    for record in history(target(tmp_path), "train"):
        by_epoch.setdefault(record["epoch"], set()).add(round(record["lr"], 10))
    assert by_epoch == {1: {0.05}, 2: {round(0.05 * 0.7, 10)}, 3: {round(0.05 * 0.49, 10)}}


def test_validation_runs_times_per_epoch_with_one_summary_line_each(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="echelon3")
    write_config(tmp_path, {"trainer": {"config": {"times_to_validate_per_epoch": 2}}})
    assert echelon3("train", tmp_path) == 0
    val = history(target(tmp_path), "val")
    assert [(r["epoch"], r["step"]) for r in val] == [(1, 3), (1, 6), (2, 9), (2, 12)]
    summaries = [r.getMessage() for r in caplog.records
                 if r.getMessage().startswith("epoch ") and "accuracy" in r.getMessage()]
    assert len(summaries) == 4
    assert summaries[0].startswith("epoch 1 step 3 |")


def test_run_leaves_config_history_and_checkpoints(tmp_path):
    write_config(tmp_path)
    assert echelon3("train", tmp_path) == 0
    out = target(tmp_path)
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["optimizer"]["config"]["lr"] == 0.05
    assert config["target"]["path"] == str(out)
    assert {"echelon3", "torch"} <= set(config["_versions"])
    assert config["_versions"]["torch"] == str(torch.__version__)
    records = history(out)
    assert all("epoch" in r and "step" in r for r in records)
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12]
    assert all({"loss", "ce", "lr"} <= set(r) for r in train)
    val = [r for r in records if r["split"] == "val"]
    assert [(r["epoch"], r["step"]) for r in val] == [(1, 6), (2, 12)]
    assert all(set(r) == {"split", "epoch", "step", "loss", "accuracy"} for r in val)
    assert {p.name for p in out.glob("*.tar")} == {".best.tar", "best.tar", "checkpoint-1.tar",
                                                  "checkpoint-2.tar"}


def test_default_logger_writes_tensorboard_too(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard is an optional extra")
    write_config(tmp_path, {"trainer": {"config": {"epochs": 1}}}, remove=("mlops",))
    assert echelon3("train", tmp_path) == 0
    assert len(list((target(tmp_path) / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert echelon3("train", tmp_path, "trainer.config.epochs=2") == 0  # resumed
    assert len(list((target(tmp_path) / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert [r["epoch"] for r in history(target(tmp_path), "val")] == [1, 2]
    # every number of history.jsonl is in TensorBoard under split/name at its step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(target(tmp_path) / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    seen = {(tag, e.step): e.value for tag in events.Tags()["scalars"]
            for e in events.Scalars(tag)}
    records = [json.loads(line) for line in
               (target(tmp_path) / "history.jsonl").read_text().splitlines()]
    wanted = {(f"{r['split']}/{k}", r["step"]): v for r in records
              for k, v in r.items() if k not in ("split", "epoch", "step") and
              isinstance(v, int | float)}
    assert wanted and seen.keys() == wanted.keys()
    assert all(seen[key] == pytest.approx(value, rel=1e-6) for key, value in wanted.items())


def test_the_no_op_logger_can_be_configured(tmp_path):
    write_config(tmp_path, {"mlops": {"module": "echelon3.observe.loggers", "type": "NoOpLogger",
                                      "config": None},
                            "trainer": {"config": {"epochs": 1}}})
    assert echelon3("train", tmp_path) == 0
    assert not (target(tmp_path) / "history.jsonl").exists()
    assert (target(tmp_path) / "checkpoint-1.tar").exists()
    NoOpLogger().log({"step": 1})  # also what ranks other than 0 get, built without a path


def test_trainer_section_may_name_the_builtin_explicitly(tmp_path):
    write_config(tmp_path, {"trainer": {"module": "echelon3.trainers.baseline",
                                        "type": "Trainer", "config": {"epochs": 1}}})
    assert echelon3("train", tmp_path) == 0
    assert (target(tmp_path) / "checkpoint-1.tar").exists()


# --------------------------------------------------------------------------- seeds


def _weights_after_training(folder, seed):
    write_config(folder, {"seed": seed})
    assert echelon3("train", folder) == 0
    return load(target(folder) / "checkpoint-2.tar")["model_state_dict"]


def test_a_root_seed_makes_runs_repeatable(tmp_path):
    first = _weights_after_training(tmp_path / "a", 7)
    again = _weights_after_training(tmp_path / "b", 7)
    other = _weights_after_training(tmp_path / "c", 8)
    assert_same_tensors(first, again)
    assert history(target(tmp_path / "a")) == history(target(tmp_path / "b"))
    assert not all(torch.equal(first[k], other[k]) for k in first)


# --------------------------------------------------------------------------- keep_best_on

AVAILABLE = ["loss", "accuracy", "f1"]


def test_keep_best_on_a_name_follows_high_is_better():
    high = KeepBest("accuracy", True, AVAILABLE)
    assert high.is_better({"accuracy": 0.5}, None)
    assert high.is_better({"accuracy": 0.6}, {"accuracy": 0.5})
    assert not high.is_better({"accuracy": 0.5}, {"accuracy": 0.5})  # a tie does not replace
    assert not high.is_better({"accuracy": 0.4}, {"accuracy": 0.5})
    low = KeepBest("loss", False, AVAILABLE)
    assert low.is_better({"loss": 0.4}, {"loss": 0.5})
    assert not low.is_better({"loss": 0.6}, {"loss": 0.5})


def test_keep_best_on_a_list_needs_every_metric_to_improve():
    rule = KeepBest(["accuracy", "f1"], True, AVAILABLE)
    best = {"accuracy": 0.5, "f1": 0.5}
    assert rule.is_better({"accuracy": 0.6, "f1": 0.6}, best)
    assert not rule.is_better({"accuracy": 0.6, "f1": 0.4}, best)
    assert not rule.is_better({"accuracy": 0.4, "f1": 0.6}, best)


def test_keep_best_on_a_mapping_with_directional_modes():
    rule = KeepBest({"loss": {"mode": "directional", "value": "low"},
                     "accuracy": {"mode": "directional", "value": "high"}}, True, AVAILABLE)
    best = {"loss": 1.0, "accuracy": 0.5}
    assert rule.is_better({"loss": 0.9, "accuracy": 0.6}, best)
    assert not rule.is_better({"loss": 1.1, "accuracy": 0.6}, best)
    assert not rule.is_better({"loss": 0.9, "accuracy": 0.4}, best)


def test_keep_best_tolerance_absolute_and_percent():
    absolute = KeepBest({"accuracy": {"mode": "tolerance", "value": 0.01, "direction": "high"}},
                        True, AVAILABLE)
    assert absolute.is_better({"accuracy": 0.895}, {"accuracy": 0.9})
    assert not absolute.is_better({"accuracy": 0.885}, {"accuracy": 0.9})
    percent = KeepBest({"loss": {"mode": "tolerance", "value": "10%", "direction": "low"}},
                       True, AVAILABLE)
    assert percent.is_better({"loss": 2.19}, {"loss": 2.0})
    assert not percent.is_better({"loss": 2.21}, {"loss": 2.0})


def test_keep_best_mixed_modes_combine_with_and():
    rule = KeepBest({"loss": {"mode": "directional", "value": "low"},
                     "accuracy": {"mode": "tolerance", "value": "1%", "direction": "high"}},
                    True, AVAILABLE)
    best = {"loss": 1.0, "accuracy": 0.8}
    assert rule.is_better({"loss": 0.9, "accuracy": 0.795}, best)  # within 1% of 0.8
    assert not rule.is_better({"loss": 0.9, "accuracy": 0.7}, best)
    assert not rule.is_better({"loss": 1.1, "accuracy": 0.9}, best)


def test_keep_best_defaults_to_the_first_metric_or_else_the_loss():
    assert [c.name for c in KeepBest(None, True, AVAILABLE).criteria] == ["accuracy"]
    only_loss = KeepBest(None, True, ["loss"])
    assert [(c.name, c.high) for c in only_loss.criteria] == [("loss", False)]


def test_keep_best_resolves_names_within_named_test_sets():
    available = ["a/loss", "b/loss", "a/accuracy"]
    rule = KeepBest(["accuracy", "b/loss"], True, available, default_set="a")
    assert [c.name for c in rule.criteria] == ["a/accuracy", "b/loss"]


@pytest.mark.parametrize("keep_best_on, key", [
    ("accuracyy", "trainer.config.keep_best_on"),
    ({"accuracy": {"mode": "sometimes"}}, "trainer.config.keep_best_on.accuracy.mode"),
    ({"accuracy": {"mode": "tolerance", "value": "a lot"}},
     "trainer.config.keep_best_on.accuracy.value"),
    ({"accuracy": {"mode": "directional", "valeu": "high"}},
     "trainer.config.keep_best_on.accuracy.valeu"),
    ({"loss": {"mode": "directional", "value": "down"}},
     "trainer.config.keep_best_on.loss.value"),
    (3, "trainer.config.keep_best_on"),
])
def test_keep_best_rejects_bad_forms_naming_the_key(keep_best_on, key):
    with pytest.raises(ConfigError) as err:
        KeepBest(keep_best_on, True, AVAILABLE)
    assert err.value.key == key


def _expected_best(val_records, better):
    best = None
    for record in val_records:
        if best is None or better(record, best):
            best = record
    return best


@pytest.mark.parametrize("keep_best_on, high_is_better, better", [
    # Loss falls while training, so "high" keeps an early checkpoint, not the last one.
    ({"loss": {"mode": "directional", "value": "high"}}, True,
     lambda new, best: new["loss"] > best["loss"]),
    ({"accuracy": {"mode": "tolerance", "value": 0.05, "direction": "high"}}, True,
     lambda new, best: new["accuracy"] >= best["accuracy"] - 0.05),
    (["loss", "accuracy"], False,
     lambda new, best: new["loss"] < best["loss"] and new["accuracy"] < best["accuracy"]),
    ("loss", False, lambda new, best: new["loss"] < best["loss"]),
])
def test_best_checkpoint_follows_keep_best_on_end_to_end(tmp_path, keep_best_on, high_is_better,
                                                          better):
    write_config(tmp_path, {"trainer": {"config": {
        "epochs": 3, "keep_best_on": keep_best_on, "high_is_better": high_is_better,
        "times_to_validate_per_epoch": 2}}})
    assert echelon3("train", tmp_path) == 0
    val = history(target(tmp_path), "val")
    expected = _expected_best(val, better)
    best = load(target(tmp_path) / "best.tar")
    assert best["global_step"] == expected["step"]
    assert best["metrics"] == {k: expected[k] for k in ("loss", "accuracy")}
    # summary.json names the epoch the winning record names (1-based, in progress)
    summary = json.loads((target(tmp_path) / "summary.json").read_text())
    assert (summary["best"]["epoch"], summary["best"]["step"]) == (expected["epoch"],
                                                                  expected["step"])
    if isinstance(keep_best_on, dict) and "loss" in keep_best_on:
        assert expected["step"] < val[-1]["step"]
        # a validation in the middle of its epoch: a later record of the same epoch exists
        assert any(r["epoch"] == expected["epoch"] and r["step"] > expected["step"]
                   for r in val)


# --------------------------------------------------------------------------- named test sets


def _named_sets(**trainer):
    test = {"module": "echelon3.datasets.digits", "type": "Digits"}
    return {
        "data": {"test": {"first": {**test, "config": {"split": "test", "limit": 48}},
                          "second": {**test, "config": {"split": "train", "limit": 32}}}},
        "trainer": {"config": trainer},
    }


def test_named_test_sets_log_set_metric_and_metrics_on_limits_metrics(tmp_path):
    write_config(tmp_path, _named_sets(metrics_on=["second"], keep_best_on="accuracy"),
                 remove=("data.test",))
    assert echelon3("train", tmp_path) == 0
    val = history(target(tmp_path), "val")
    assert len(val) == 2
    for record in val:
        assert set(record) == {"split", "epoch", "step", "first/loss", "second/loss",
                               "second/accuracy"}
    best = load(target(tmp_path) / "best.tar")
    # keep_best_on "accuracy" means the accuracy of the first metrics_on set.
    assert best["global_step"] == _expected_best(
        val, lambda new, old: new["second/accuracy"] > old["second/accuracy"])["step"]


def test_named_test_sets_compute_metrics_on_every_set_by_default(tmp_path):
    write_config(tmp_path, _named_sets(epochs=1, keep_best_on="first/loss",
                                       high_is_better=False), remove=("data.test",))
    assert echelon3("train", tmp_path) == 0
    (record,) = history(target(tmp_path), "val")
    assert {"first/accuracy", "second/accuracy", "first/loss", "second/loss"} <= set(record)
    # The two sets differ, so their numbers are computed separately.
    assert record["first/loss"] != record["second/loss"]


def test_metrics_on_an_unknown_set_is_a_config_error(tmp_path, capsys):
    write_config(tmp_path, _named_sets(metrics_on=["third"]), remove=("data.test",))
    assert echelon3("train", tmp_path) == 2
    err = capsys.readouterr().err
    assert "trainer.config.metrics_on" in err and "third" in err


def test_keep_best_on_an_unknown_metric_is_a_config_error(tmp_path, capsys):
    write_config(tmp_path, {"trainer": {"config": {"keep_best_on": "acuracy"}}})
    assert echelon3("train", tmp_path) == 2
    err = capsys.readouterr().err
    assert "trainer.config.keep_best_on" in err and "accuracy" in err


def test_named_sets_through_the_trainer_directly(tmp_path):
    inputs, labels = blobs()
    trainer = make_trainer(
        tmp_path, epochs=1, named_sets=True, metrics_on="easy",
        test_loaders={"easy": loader(inputs, labels), "shuffled": loader(
            inputs, labels[torch.randperm(len(labels))])})
    trainer.fit()
    (record,) = trainer.logger.split("val")
    assert set(record) == {"split", "epoch", "step", "easy/loss", "shuffled/loss",
                           "easy/accuracy"}


# --------------------------------------------------------------------------- built-in components


def test_digits_split_is_deterministic_normalised_and_1x8x8():
    from echelon3.datasets.digits import Digits

    train, test = Digits("train"), Digits("test")
    assert (len(train), len(test)) == (1347, 450)
    assert train[0][0].shape == (1, 8, 8) and train[0][1].dtype == torch.int64
    assert abs(train.images.mean().item()) < 1e-4 and abs(train.images.std().item() - 1) < 1e-2
    assert torch.equal(Digits("test").images, test.images)
    assert torch.equal(Digits("test").labels, test.labels)
    assert set(test.labels.tolist()) == set(range(10))
    assert torch.equal(Digits("test", limit=10).labels, test.labels[:10])
    with pytest.raises(ValueError):
        Digits("validation")


def test_builtin_networks_map_digit_images_to_ten_logits():
    from echelon3.nets.cnn import SmallCNN
    from echelon3.nets.mlp import MLP, make_mlp

    images = torch.randn(5, 1, 8, 8)
    for net in (SmallCNN(), MLP(), make_mlp(hidden=16), MLP(depth=3, dropout=0.2)):
        assert net(images).shape == (5, 10)
