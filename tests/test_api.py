"""The Python API (``echelon3.load``, ``echelon3.predict``) on one trained digits run whose
export fuses the test set's preprocess: its outputs on raw inputs are what ``echelon3 run``
wrote (on the transformed inputs) and score what ``echelon3 evaluate`` wrote."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

import echelon3
from echelon3.config.errors import UserError
from echelon3.datasets.digits import Digits
from tests.helpers import assert_same_tensors, echelon3 as cli, load, write_config

TEST_LIMIT = 48


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 1-epoch run with ``export.preprocess: dataset``, its predictions.csv and
    metrics.json: (run folder, the test set)."""
    folder = tmp_path_factory.mktemp("api")
    write_config(folder, {"data": {"train": {"config": {"limit": 96}},
                                   "test": {"config": {"limit": TEST_LIMIT}}},
                          "trainer": {"config": {"epochs": 1}},
                          "export": {"preprocess": "dataset"}})
    for task in ("train", "run", "evaluate"):
        assert cli(task, folder) == 0, task
    return folder / "out", Digits(split="test", limit=TEST_LIMIT)


def raw_inputs(dataset) -> torch.Tensor:
    return torch.stack([dataset.raw_input(i) for i in range(len(dataset))])


def test_predict_on_raw_inputs_is_what_run_and_evaluate_wrote(run):
    folder, dataset = run
    outputs = echelon3.predict(folder, raw_inputs(dataset))
    assert outputs.shape == (TEST_LIMIT, 10)
    rows = list(csv.DictReader(open(folder / "predictions.csv")))
    assert [int(r["index"]) for r in rows] == list(range(TEST_LIMIT))
    written = torch.tensor([[float(r[f"score_{k}"]) for k in range(10)] for r in rows])
    torch.testing.assert_close(torch.softmax(outputs, 1), written, rtol=1e-5, atol=1e-6)
    assert outputs.argmax(1).tolist() == [int(r["prediction"]) for r in rows]
    right = sum(int(p == dataset[i][1]) for i, p in enumerate(outputs.argmax(1).tolist()))
    scored = json.loads((folder / "metrics.json").read_text())
    assert scored["accuracy"] == pytest.approx(right / TEST_LIMIT, abs=1e-7)


def test_load_gives_best_tars_weights_in_eval_mode_with_the_sets_preprocess(run):
    folder, dataset = run
    model = echelon3.load(folder)
    assert not model.training and not model.net.training
    assert model.checkpoint == folder / "best.tar"
    assert_same_tensors(model.net.state_dict(), load(folder / "best.tar")["model_state_dict"])
    raw = raw_inputs(dataset)
    assert torch.equal(model.preprocess(raw), dataset.images)  # Digits' own transform
    with torch.no_grad():
        expected = model.net(dataset.images)
    assert torch.equal(echelon3.predict(model, raw), expected)


def test_predict_takes_samples_pieces_and_a_loaded_model_alike(run):
    folder, dataset = run
    model = echelon3.load(folder)
    raw = raw_inputs(dataset)
    whole = echelon3.predict(model, raw)
    # in pieces: the same up to float rounding (the matrix products block differently)
    torch.testing.assert_close(echelon3.predict(model, raw, batch_size=7), whole,
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(echelon3.predict(model, list(raw)), whole)
    assert torch.equal(echelon3.predict(model, raw.numpy()), whole)


def test_a_folder_without_a_run_is_one_error_naming_the_file(tmp_path):
    with pytest.raises(UserError, match=r"config.yaml: not found: a trained run folder"):
        echelon3.load(tmp_path)


def test_import_echelon3_imports_no_torch():
    code = "import sys, echelon3; assert {'load', 'predict'} <= set(dir(echelon3)); " \
           "assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
