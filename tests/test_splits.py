"""Three roles for data: ``data.val`` / ``data.val_split`` choose best.tar, ``data.test``
scores it, and without validation data every report says the test set chose."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from sklearn.model_selection import train_test_split
from torch.utils.data import Dataset, Subset

from echelon3.config.errors import ConfigError
from echelon3.data import splits
from echelon3.datasets.digits import Digits
from echelon3.nets.mlp import MLP
from tests.helpers import TRAIN_LIMIT, echelon3, history, load, target, write_config


def _accuracy(state: dict, dataset: Dataset) -> float:
    """The accuracy of a checkpoint's weights on ``dataset``, computed here."""
    net = MLP(hidden=32, dropout=0.1)
    net.load_state_dict(state["model_state_dict"])
    net.eval()
    x = torch.stack([dataset[i][0] for i in range(len(dataset))])
    y = torch.stack([torch.as_tensor(dataset[i][1]) for i in range(len(dataset))])
    with torch.no_grad():
        return (net(x).argmax(1) == y).float().mean().item()


# --------------------------------------------------------------------------- the split itself


def test_val_split_is_disjoint_complete_stratified_and_seeded():
    digits = Digits("train")
    train, val = splits.carve(digits, 0.2, seed=0)
    assert isinstance(train, Subset) and isinstance(val, Subset)
    assert len(val) == math.ceil(0.2 * len(digits)) and len(train) + len(val) == len(digits)
    assert not set(train.indices) & set(val.indices)
    assert sorted(train.indices + val.indices) == list(range(len(digits)))
    # stratified: every class gives its share (within one sample) to validation
    labels = digits.labels.numpy()
    per_class = Counter(labels[val.indices].tolist())
    for label, count in Counter(labels.tolist()).items():
        assert abs(per_class[label] - 0.2 * count) <= 1, label
    # drawn from the seed, as scikit-learn draws it
    _, expected = train_test_split(np.arange(len(digits)), test_size=len(val), random_state=0,
                                   stratify=labels)
    assert val.indices == sorted(expected.tolist())
    assert splits.carve(digits, 0.2, seed=0)[1].indices == val.indices
    assert splits.carve(digits, 0.2, seed=1)[1].indices != val.indices


def test_a_count_takes_that_many_and_unlabelled_data_splits_at_random():
    class Plain(Dataset):
        def __len__(self):
            return 50

        def __getitem__(self, i):
            return torch.tensor([float(i)]), 0

    train, val = splits.carve(Plain(), 7, seed=3)
    assert (len(train), len(val)) == (43, 7)
    assert not set(train.indices) & set(val.indices)
    assert splits.labels_of(Plain()) is None


@pytest.mark.parametrize("value, words", [
    (0.0, "strictly between 0 and 1"), (1.0, "strictly between 0 and 1"),
    (-0.5, "strictly between 0 and 1"), (0, "both need at least one"),
    (100, "leaves 0 to train on"), (True, "fraction in (0, 1) or a whole number"),
    ("20%", "fraction in (0, 1) or a whole number"),
])
def test_bad_val_split_values_name_the_key(value, words):
    with pytest.raises(ConfigError, match=r"^data\.val_split: ") as caught:
        splits.val_size(value, 100)
    assert words in str(caught.value)


def test_bad_val_split_stops_train_with_exit_2_and_one_line(tmp_path, capsys):
    write_config(tmp_path, {"data": {"val_split": 1.5}})
    assert echelon3("train", tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "echelon3: error: data.val_split: a fraction must lie strictly between " \
        "0 and 1, got 1.5"
    assert not (target(tmp_path) / "summary.json").exists()


def test_val_of_the_wrong_kind_names_the_key(tmp_path, capsys):
    write_config(tmp_path, {"data": {"val": 5}})
    assert echelon3("train", tmp_path) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "echelon3: error: data.val: must be a dataset (module, type, config) or named sets, "
        "got 5")


def test_val_and_val_split_together_are_refused(tmp_path, capsys):
    write_config(tmp_path, {"data": {"val_split": 0.1, "val": {
        "module": "echelon3.datasets.digits", "type": "Digits", "config": {"limit": 10}}}})
    assert echelon3("train", tmp_path) == 2
    assert "data.val_split: give data.val or data.val_split, not both" in capsys.readouterr().err


# --------------------------------------------------------------------------- training with it


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    """The helpers' run with ``data.val_split: 0.2``, trained and evaluated."""
    folder = tmp_path_factory.mktemp("split")
    write_config(folder, {"data": {"val_split": 0.2}})
    assert echelon3("train", folder) == 0
    assert echelon3("evaluate", folder) == 0
    return folder


def test_the_train_set_loses_the_validation_samples(split_run):
    held_out = math.ceil(0.2 * TRAIN_LIMIT)  # 39 of 192
    steps_per_epoch = (TRAIN_LIMIT - held_out) // 32  # batch 32, drop_last: 4, not 6
    val = history(target(split_run), "val")
    assert [r["step"] for r in val] == [steps_per_epoch, 2 * steps_per_epoch]


def test_validation_scores_are_the_held_out_samples_and_metrics_json_the_test_set(split_run):
    out = target(split_run)
    digits = Digits("train", limit=TRAIN_LIMIT)
    _, expected = train_test_split(np.arange(TRAIN_LIMIT), test_size=39, random_state=0,
                                   stratify=digits.labels.numpy())
    held_out = Subset(digits, sorted(expected.tolist()))
    last = load(out / "checkpoint-2.tar")
    assert history(out, "val")[-1]["accuracy"] == pytest.approx(_accuracy(last, held_out),
                                                                abs=1e-6)
    best = load(out / "best.tar")
    assert best["selected_on"] == "val"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["selected_on"] == "val"
    test_set = Digits("test", limit=96)
    assert metrics["accuracy"] == pytest.approx(_accuracy(best, test_set), abs=1e-6)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"]["selected_on"] == "val"


SHUFFLED = '''
import torch
from echelon3.datasets.digits import Digits


class Relabelled(Digits):
    """Digits whose labels are moved on by one: a validation set that disagrees with
    the test set about which epoch is best."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.labels = (self.labels + 1) % 10
'''


def test_best_tar_is_chosen_on_the_validation_set_not_the_test_set(tmp_path):
    """Validation (data.val) and test disagree about the best epoch: best.tar follows
    validation, and the history's validation numbers are data.val's."""
    (tmp_path / "relabelled.py").write_text(SHUFFLED)
    write_config(tmp_path, {
        "data": {"val": {"module": "relabelled.py", "type": "Relabelled",
                         "config": {"split": "train", "limit": 96}}},
        "trainer": {"config": {"epochs": 4}}, "target": {"checkpoints_to_keep": 4}})
    assert echelon3("train", tmp_path) == 0
    out = target(tmp_path)
    relabelled = Digits("train", limit=96)
    relabelled.labels = (relabelled.labels + 1) % 10
    test_set = Digits("test", limit=96)
    states = [load(out / f"checkpoint-{e}.tar") for e in range(1, 5)]
    val_scores = [r["accuracy"] for r in history(out, "val")]
    assert val_scores == pytest.approx([_accuracy(s, relabelled) for s in states], abs=1e-6)
    test_scores = [_accuracy(s, test_set) for s in states]
    first_best = lambda scores: 1 + scores.index(max(scores))  # noqa: E731 (keep-best: strict >)
    assert first_best(val_scores) != first_best(test_scores)  # the two sets disagree
    best = load(out / "best.tar")
    assert best["epoch"] == first_best(val_scores)
    assert best["selected_on"] == "val"


def test_a_validation_loader_of_its_own_is_used(tmp_path):
    """dataloaders.val loads data.val (here a loader that records its batch size)."""
    (tmp_path / "spy.py").write_text(
        "from pathlib import Path\n"
        "from torch.utils.data import DataLoader\n\n"
        "def Spy(**kwargs):\n"
        "    Path(__file__).with_name('used.txt').write_text(str(kwargs['batch_size']))\n"
        "    return DataLoader(**kwargs)\n")
    write_config(tmp_path, {"data": {"val_split": 16},
                            "trainer": {"config": {"epochs": 1}},
                            "dataloaders": {"val": {"module": "spy.py", "type": "Spy",
                                                    "config": {"batch_size": 5}}}})
    assert echelon3("train", tmp_path) == 0
    assert (tmp_path / "used.txt").read_text() == "5"


def test_without_validation_data_the_test_set_chooses_and_says_so(tmp_path, capsys):
    write_config(tmp_path, {"trainer": {"config": {"epochs": 1}}})
    assert echelon3("train", tmp_path) == 0
    assert echelon3("evaluate", tmp_path) == 0
    err = capsys.readouterr().err
    assert "selected on the test set" in err
    out = target(tmp_path)
    assert json.loads((out / "metrics.json").read_text())["selected_on"] == "test"
    assert json.loads((out / "summary.json").read_text())["best"]["selected_on"] == "test"
