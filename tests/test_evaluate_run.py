"""``echelon3 evaluate`` (metrics.json) and ``echelon3 run`` (predictions.csv),
checked against a recomputation from the checkpoint."""

from __future__ import annotations

import csv
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

from echelon3.datasets.digits import Digits
from echelon3.nets.mlp import MLP
from echelon3.tasks.run import Runner
from tests.helpers import TEST_LIMIT, echelon3, load, target, write_config


@pytest.fixture
def run_dir(trained, tmp_path):
    """A private copy of the trained run, configured as ``run.yaml`` in tmp_path."""
    shutil.copytree(target(trained), target(tmp_path))
    write_config(tmp_path)
    for produced in ("metrics.json", "predictions.csv"):
        (target(tmp_path) / produced).unlink(missing_ok=True)
    return tmp_path


def _net(checkpoint: Path) -> MLP:
    net = MLP(hidden=32, dropout=0.1)
    net.load_state_dict(load(checkpoint)["model_state_dict"])
    return net.eval()


@torch.no_grad()
def _recompute(checkpoint: Path, dataset) -> dict[str, float]:
    images, labels = dataset.images, dataset.labels
    logits = _net(checkpoint)(images)
    return {"accuracy": (logits.argmax(1) == labels).float().mean().item(),
            "loss": torch.nn.functional.cross_entropy(logits, labels).item()}


def _metrics(path: Path) -> dict:
    """metrics.json's metrics; it also says which data chose the checkpoint: these runs
    have no validation data, so the test set did."""
    metrics = json.loads(path.read_text())
    assert metrics.pop("selected_on") == "test"
    return metrics


def _assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=1e-6), key


def _rows(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


# --------------------------------------------------------------------------- evaluate


def test_metrics_json_equals_a_recomputation_from_best(run_dir, caplog):
    caplog.set_level(logging.INFO)
    assert echelon3("evaluate", run_dir) == 0
    out = target(run_dir)
    metrics = _metrics(out / "metrics.json")
    _assert_close(metrics, _recompute(out / "best.tar", Digits("test", limit=TEST_LIMIT)))
    table = "\n".join(r.getMessage() for r in caplog.records)
    assert "accuracy" in table and f"{metrics['accuracy']:.4f}" in table


def test_evaluate_a_named_checkpoint_into_a_named_file(run_dir):
    out = target(run_dir)
    custom = run_dir / "elsewhere" / "scores.json"
    assert echelon3("evaluate", run_dir, "+evaluator.config.checkpoint=checkpoint-1.tar",
                    f"+evaluator.config.output={custom}") == 0
    assert not (out / "metrics.json").exists()
    metrics = json.loads(custom.read_text())
    # no validation chose checkpoint-1.tar (best.tar is another file): nothing claims one did
    assert "selected_on" not in metrics
    first = _recompute(out / "checkpoint-1.tar", Digits("test", limit=TEST_LIMIT))
    _assert_close(metrics, first)
    assert first != _recompute(out / "best.tar", Digits("test", limit=TEST_LIMIT))


NAMED_TEST = {"data": {"test": {
    "small": {"module": "echelon3.datasets.digits", "type": "Digits",
              "config": {"split": "test", "limit": 40}},
    "seen": {"module": "echelon3.datasets.digits", "type": "Digits",
             "config": {"split": "train", "limit": 50}},
}}}


def test_evaluate_named_sets_writes_set_slash_metric(run_dir):
    write_config(run_dir, NAMED_TEST, name="named", remove=("data.test",))
    assert echelon3("evaluate", run_dir, name="named") == 0
    metrics = _metrics(target(run_dir) / "metrics.json")
    best = target(run_dir) / "best.tar"
    expected = {}
    for name, dataset in (("small", Digits("test", limit=40)), ("seen", Digits("train",
                                                                               limit=50))):
        expected.update({f"{name}/{k}": v for k, v in _recompute(best, dataset).items()})
    _assert_close(metrics, expected)


def test_evaluate_metrics_on_limits_metrics_to_some_sets(run_dir):
    write_config(run_dir, {**NAMED_TEST, "evaluator": {"config": {"metrics_on": "seen"}}},
                 name="named", remove=("data.test",))
    assert echelon3("evaluate", run_dir, name="named") == 0
    metrics = _metrics(target(run_dir) / "metrics.json")
    assert set(metrics) == {"small/loss", "seen/loss", "seen/accuracy"}


CUSTOM_TASKS = '''
import json
from pathlib import Path

from echelon3.tasks.run import Runner


class SampleCounter:
    """A custom evaluator: counts the samples of each test set."""

    def __init__(self, path, output="counts.json"):
        self.output = Path(path) / output

    def __call__(self, *, net, test_loaders, metrics, losses, precision, device, named_sets):
        counts = {name: len(loader.dataset) for name, loader in test_loaders.items()}
        self.output.write_text(json.dumps(counts))
        return counts


class TsvRunner(Runner):
    """A custom runner: the built-in one, another default file."""

    def __init__(self, path, **kwargs):
        kwargs.setdefault("output", str(Path(path) / "predictions.tsv"))
        super().__init__(path, **kwargs)
'''


def test_custom_evaluator_and_runner_classes_are_accepted(run_dir):
    (run_dir / "custom.py").write_text(CUSTOM_TASKS)
    write_config(run_dir, {"evaluator": {"module": "custom.py", "type": "SampleCounter"},
                           "runner": {"module": "custom.py", "type": "TsvRunner"}},
                 name="custom")
    assert echelon3("evaluate", run_dir, name="custom") == 0
    assert echelon3("run", run_dir, name="custom") == 0
    out = target(run_dir)
    assert json.loads((out / "counts.json").read_text()) == {"test": TEST_LIMIT}
    assert len(_rows(out / "predictions.tsv")[1]) == TEST_LIMIT
    assert not (out / "metrics.json").exists() and not (out / "predictions.csv").exists()


def test_an_evaluator_with_module_but_no_type_is_an_error(run_dir, capsys):
    write_config(run_dir, {"evaluator": {"module": "echelon3.tasks.evaluate"}}, name="half")
    assert echelon3("evaluate", run_dir, name="half") == 2
    assert "evaluator" in capsys.readouterr().err


# --------------------------------------------------------------------------- run


def test_predictions_csv_has_one_row_per_sample_with_class_and_scores(run_dir):
    assert echelon3("run", run_dir) == 0
    out = target(run_dir)
    header, rows = _rows(out / "predictions.csv")
    assert header == ["index", "prediction", *(f"score_{k}" for k in range(10))]
    assert [int(r["index"]) for r in rows] == list(range(TEST_LIMIT))
    dataset = Digits("test", limit=TEST_LIMIT)
    with torch.no_grad():
        probs = torch.softmax(_net(out / "best.tar")(dataset.images), 1)
    for row, p in zip(rows, probs):
        scores = torch.tensor([float(row[f"score_{k}"]) for k in range(10)])
        assert torch.allclose(scores, p, rtol=1e-4, atol=1e-7)
        assert int(row["prediction"]) == int(p.argmax())


def test_run_on_runner_data_into_a_named_file(run_dir):
    output = run_dir / "preds" / "train.csv"
    data = {"module": "echelon3.datasets.digits", "type": "Digits",
            "config": {"split": "train", "limit": 40}}
    write_config(run_dir, {"runner": {"config": {"data": data, "output": str(output),
                                                 "checkpoint": "checkpoint-1.tar"}}},
                 name="infer")
    assert echelon3("run", run_dir, name="infer") == 0
    assert not (target(run_dir) / "predictions.csv").exists()
    _, rows = _rows(output)
    assert len(rows) == 40
    with torch.no_grad():
        logits = _net(target(run_dir) / "checkpoint-1.tar")(Digits("train", limit=40).images)
    assert [int(r["prediction"]) for r in rows] == logits.argmax(1).tolist()


UNLABELLED = '''
from echelon3.datasets.digits import Digits


class Images(Digits):
    """Images only, as data to predict on usually comes."""

    def __getitem__(self, index):
        return self.images[index]
'''


def test_run_on_data_without_labels(run_dir):
    (run_dir / "unlabelled.py").write_text(UNLABELLED)
    data = {"module": "unlabelled.py", "type": "Images", "config": {"split": "test",
                                                                     "limit": 30}}
    write_config(run_dir, {"runner": {"config": {"data": data}}}, name="infer")
    assert echelon3("run", run_dir, name="infer") == 0
    _, rows = _rows(target(run_dir) / "predictions.csv")
    assert [int(r["index"]) for r in rows] == list(range(30))


def test_run_on_named_test_sets_adds_a_set_column(run_dir):
    write_config(run_dir, NAMED_TEST, name="named", remove=("data.test",))
    assert echelon3("run", run_dir, name="named") == 0
    header, rows = _rows(target(run_dir) / "predictions.csv")
    assert header[:3] == ["index", "set", "prediction"]
    assert [(r["set"], int(r["index"])) for r in rows] == (
        [("small", i) for i in range(40)] + [("seen", i) for i in range(50)])


def test_single_output_predictions_are_values_without_scores(tmp_path):
    runner = Runner(str(tmp_path))
    runner.write([("test", 0, torch.tensor([0.25])), ("test", 1, torch.tensor(-1.5))], False)
    header, rows = _rows(tmp_path / "predictions.csv")
    assert header == ["index", "prediction"]
    assert [float(r["prediction"]) for r in rows] == [0.25, -1.5]


# --------------------------------------------------------------------------- the shipped example


def test_the_digits_cnn_example_trains_evaluates_and_runs(tmp_path):
    """The README's default: trains on the CPU and reaches >= 95% test accuracy."""
    examples = Path(__file__).resolve().parents[1] / "config" / "experiments"
    args = ["-cd", str(examples), "-cn", "digits_cnn", "device=cpu", f"target.path={tmp_path}",
            "++trainer.config.progress_bar=false"]
    from echelon3 import cli

    assert cli.main(["train", *args]) == 0
    assert cli.main(["evaluate", *args]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["accuracy"] >= 0.95
    assert cli.main(["run", *args]) == 0
    assert len(_rows(tmp_path / "predictions.csv")[1]) == 450
