"""Runs measured in steps: ``max_steps``, validation every N steps (``val_check_interval``,
``limit_val_batches``, ``validate_at_start``), step checkpoints (``target.every_n_steps``),
early stopping by step and ``resume_from``. Each is compared with a straight run or a hand
count (digits: 192 training samples in batches of 32, so 6 optimizer steps an epoch)."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from echelon3.datasets.digits import Digits
from echelon3.nets.mlp import MLP
from tests.helpers import TEST_LIMIT, echelon3, history, load, same_nested, target, write_config

PER_EPOCH = 6


def steps_config(folder, **trainer):
    write_config(folder, {"trainer": {"config": {"epochs": None, **trainer}}})


def summary(folder):
    return json.loads((target(folder) / "summary.json").read_text())


def final_state(folder):
    newest = sorted(target(folder).glob("checkpoint-*.tar"),
                    key=lambda p: (load(p)["global_step"]))[-1]
    return newest.name, load(newest)


def same_state(a, b):
    for key in ("model_state_dict", "optimizer_state_dict", "scheduler_state_dict",
                "global_step", "epoch", "metrics"):
        assert same_nested(a[key], b[key]), key


def test_max_steps_ends_mid_epoch_and_a_longer_max_steps_goes_on_exactly(tmp_path):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    steps_config(straight, max_steps=10)
    steps_config(cut, max_steps=7)
    assert echelon3("train", straight) == 0
    assert echelon3("train", cut) == 0
    assert final_state(cut)[0] == "checkpoint-1-step7.tar"
    assert (summary(cut)["steps"], summary(cut)["epochs"]) == (7, 1)
    assert echelon3("train", cut, "trainer.config.max_steps=10") == 0
    name, state = final_state(cut)
    assert name == final_state(straight)[0] == "checkpoint-1-step10.tar"
    same_state(state, final_state(straight)[1])
    # The shorter run ended with a validation and a record of its last interval at step 7.
    assert [r["step"] for r in history(target(straight), "val")] == [6, 10]
    assert [r["step"] for r in history(target(cut), "val")] == [6, 7, 10]
    assert history(target(cut), "val")[-1] == history(target(straight), "val")[-1]
    assert summary(cut)["steps_trained"] == 3 and summary(cut)["resumed_from"] == \
        "checkpoint-1-step7.tar"
    assert echelon3("train", cut, "trainer.config.max_steps=10") == 0  # nothing left
    assert summary(cut)["steps_trained"] == 0


@pytest.mark.parametrize("epochs, max_steps, steps", [(1, 100, PER_EPOCH), (5, 8, 8)])
def test_epochs_and_max_steps_end_at_whichever_comes_first(tmp_path, epochs, max_steps, steps):
    write_config(tmp_path, {"trainer": {"config": {"epochs": epochs, "max_steps": max_steps}},
                            "scheduler": {"module": "torch.optim.lr_scheduler",
                                          "type": "CosineAnnealingLR", "interval": "step",
                                          "config": {"T_max": "total_steps"}}},
                 remove=("scheduler",))
    assert echelon3("train", tmp_path) == 0
    state = final_state(tmp_path)[1]
    assert state["global_step"] == steps
    assert state["scheduler_state_dict"]["T_max"] == steps  # total_steps: the real total


def test_a_changed_max_steps_with_a_schedule_length_is_refused(tmp_path, capsys):
    write_config(tmp_path, {"trainer": {"config": {"epochs": None, "max_steps": 4}},
                            "scheduler": {"module": "torch.optim.lr_scheduler",
                                          "type": "CosineAnnealingLR", "interval": "step",
                                          "config": {"T_max": "max_steps"}}},
                 remove=("scheduler",))
    assert echelon3("train", tmp_path) == 0
    assert echelon3("train", tmp_path, "trainer.config.max_steps=8") == 2
    assert "trainer.config.max_steps: changed from 4 to 8" in capsys.readouterr().err
    assert echelon3("train", tmp_path, "trainer.config.max_steps=8",
                    "trainer.config.extend=keep_schedule") == 0


def test_validation_every_n_steps_on_the_first_batches(tmp_path):
    steps_config(tmp_path, max_steps=10, val_check_interval=4, validate_at_start=True,
                 limit_val_batches=1)
    assert echelon3("train", tmp_path) == 0
    val = history(target(tmp_path), "val")
    assert [r["step"] for r in val] == [0, 4, 8, 10]
    # The last validation, by hand: the final weights on the first test batch (64 samples).
    state = final_state(tmp_path)[1]
    net = MLP(hidden=32, dropout=0.1)
    net.load_state_dict(state["model_state_dict"])
    net.eval()
    data = Digits(split="test", limit=TEST_LIMIT)
    inputs = torch.stack([data[i][0] for i in range(64)])
    labels = torch.tensor([int(data[i][1]) for i in range(64)])
    with torch.no_grad():
        logits = net(inputs)
    assert val[-1]["loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)
    assert val[-1]["accuracy"] == pytest.approx(
        (logits.argmax(1) == labels).float().mean().item(), abs=1e-6)
    best = max(val, key=lambda r: r["accuracy"])  # the first of equals wins
    assert load(target(tmp_path) / "best.tar")["global_step"] == best["step"]


def test_early_stopping_counts_validations_by_step(tmp_path):
    write_config(tmp_path, {"optimizer": {"config": {"lr": 0.0}},
                            "trainer": {"config": {"epochs": None, "max_steps": 30,
                                                   "val_check_interval": 2,
                                                   "early_stopping": {"patience": 1}}}})
    assert echelon3("train", tmp_path) == 0
    assert [r["step"] for r in history(target(tmp_path), "val")] == [2, 4]
    assert final_state(tmp_path)[0] == "checkpoint-0-step4.tar"
    assert "after step 4" in summary(tmp_path)["stopped_early"]
    assert echelon3("train", tmp_path) == 0
    assert summary(tmp_path)["steps_trained"] == 0


def test_step_checkpoints_roll_with_their_own_retention(tmp_path):
    write_config(tmp_path, {"trainer": {"config": {"epochs": None, "max_steps": 11}},
                            "target": {"every_n_steps": 3, "step_checkpoints_to_keep": 2}})
    assert echelon3("train", tmp_path) == 0
    # Steps 3 (superseded by epoch 1's checkpoint at 6), 9, and 11 where the run ends.
    names = sorted(p.name for p in target(tmp_path).glob("checkpoint-*.tar"))
    assert names == ["checkpoint-1-step11.tar", "checkpoint-1-step9.tar", "checkpoint-1.tar"]
    straight = tmp_path / "straight"
    steps_config(straight, max_steps=11)
    assert echelon3("train", straight) == 0
    # A step checkpoint is the whole state: going on from step 9 ends as the straight run.
    for p in target(tmp_path).glob("checkpoint-1-step11.tar"):
        p.unlink()
    assert echelon3("train", tmp_path) == 0
    same_state(load(target(tmp_path) / "checkpoint-1-step11.tar"), final_state(straight)[1])
    assert history(target(tmp_path)) == history(target(straight))


def test_resume_from_a_chosen_checkpoint_keeps_the_later_ones_aside(tmp_path, capsys):
    write_config(tmp_path, {"trainer": {"config": {"epochs": 3}},
                            "target": {"checkpoints_to_keep": 3}})
    assert echelon3("train", tmp_path) == 0
    out = target(tmp_path)
    originals = {n: load(out / n) for n in ("checkpoint-2.tar", "checkpoint-3.tar")}
    shutil.copy(out / "history.jsonl", tmp_path / "history.jsonl")
    assert echelon3("train", tmp_path, "resume_from=checkpoint-1.tar",
                    "trainer.config.epochs=2") == 0
    assert summary(tmp_path)["resumed_from"] == "checkpoint-1.tar"
    same_state(load(out / "checkpoint-2.tar"), originals["checkpoint-2.tar"])
    aside = out / "set-aside"
    # checkpoint-2 was passed (written again), checkpoint-3 not yet: it is kept.
    assert sorted(p.name for p in aside.glob("checkpoint-*")) == ["checkpoint-3.tar"]
    assert (aside / "history.jsonl").read_text() == (tmp_path / "history.jsonl").read_text()
    assert echelon3("train", tmp_path, "resume_from=checkpoint-9.tar") == 2
    err = capsys.readouterr().err
    assert "resume_from: checkpoint-9.tar is not a checkpoint of this run" in err


def test_step_checkpoints_written_in_the_background_equal_the_synchronous_ones(tmp_path):
    runs = {}
    for mode in ("sync", "async"):
        write_config(tmp_path / mode, {
            "trainer": {"config": {"epochs": None, "max_steps": 11}},
            "target": {"every_n_steps": 3, "step_checkpoints_to_keep": 2,
                       "async_save": mode == "async"}})
        assert echelon3("train", tmp_path / mode) == 0
        runs[mode] = {p.name: load(p) for p in target(tmp_path / mode).glob("checkpoint-*")}
    assert sorted(runs["async"]) == ["checkpoint-1-step11.tar", "checkpoint-1-step9.tar",
                                     "checkpoint-1.tar"] == sorted(runs["sync"])
    for name, state in runs["sync"].items():
        same_state(runs["async"][name], state)


def test_every_n_minutes_saves_at_the_step_after_a_log_point(tmp_path):
    # A clock that is always up: rank 0 says so at each log point, the save follows the
    # next one (whose collective carries it).
    write_config(tmp_path, {"trainer": {"config": {"epochs": None, "max_steps": 5}},
                            "target": {"every_n_minutes": 1e-9, "step_checkpoints_to_keep": 5}})
    assert echelon3("train", tmp_path) == 0
    steps = sorted(load(p)["global_step"] for p in target(tmp_path).glob("checkpoint-0-step*"))
    assert steps == [4, 5]  # log points at 2 and 4 (log_every_n_steps 2); 5 ends the run


def test_a_stream_validation_set_cut_to_its_first_batch(tmp_path):
    from tests.combo import ComboNet, StreamBlobs

    write_config(tmp_path, {
        "net": {"module": "tests.combo", "type": "ComboNet", "config": {"hidden": 8}},
        "data": {"train": {"module": "tests.combo", "type": "NoisyBlobs", "config": {"size": 48}},
                 "test": {"module": "tests.combo", "type": "StreamBlobs",
                          "config": {"size": 24, "seed": 1}}},
        "dataloaders": {"test": {"config": {"batch_size": 8}},
                        "train": {"config": {"batch_size": 8}}},
        "metrics": [],
        "trainer": {"config": {"epochs": None, "max_steps": 4, "limit_val_batches": 1,
                               "keep_best_on": "loss", "high_is_better": False}}},
        remove=("net", "data", "metrics"))
    assert echelon3("train", tmp_path) == 0
    stream = StreamBlobs(size=24, seed=1)
    stream.set_shard(0, 1)
    first = list(itertools.islice(iter(stream), 8))  # the stream's own first batch
    net = ComboNet(hidden=8)
    net.load_state_dict(final_state(tmp_path)[1]["model_state_dict"])
    net.eval()
    with torch.no_grad():
        logits = net(torch.stack([x for x, _ in first]))
    labels = torch.stack([y for _, y in first])
    val = history(target(tmp_path), "val")
    assert val[-1]["loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)
