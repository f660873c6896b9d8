"""The custom metric contract, its cross-rank hook, and metrics rejected when a run is built."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from echelon3.metrics.base import Metric, all_reduce_sum_, is_usable_metric, reduce_and_compute
from tests.helpers import echelon3, history, target, write_config


class Accuracy(Metric):
    """Counter-based accuracy, exact under DDP through dist_reduce."""

    def __init__(self):
        self.correct = torch.zeros((), dtype=torch.int64)
        self.total = torch.zeros((), dtype=torch.int64)
        self.calls: list[str] = []

    def update(self, preds, target):
        self.correct += (preds.argmax(-1) == target).sum()
        self.total += target.numel()

    def dist_reduce(self):
        self.calls.append("dist_reduce")
        all_reduce_sum_(self.correct, self.total)

    def compute(self):
        self.calls.append("compute")
        return self.correct / self.total

    def reset(self):
        self.correct.zero_()
        self.total.zero_()


def test_a_custom_metric_accumulates_resets_and_reduces_before_compute():
    metric = Accuracy()
    metric.update(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([0, 0]))
    metric.update(torch.tensor([[0.3, 0.7]]), torch.tensor([1]))
    assert reduce_and_compute(metric) == pytest.approx(2 / 3)
    assert metric.calls == ["dist_reduce", "compute"]
    metric.reset()
    metric.update(torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    assert reduce_and_compute(metric) == 1.0


def test_the_contract_is_abstract_and_the_hook_a_no_op():
    class Incomplete(Metric):
        def update(self, preds, target):
            pass

    with pytest.raises(TypeError):
        Incomplete()

    class Mean(Metric):
        def __init__(self):
            self.values = []

        def update(self, preds, target):
            self.values.append(float(preds.mean()))

        def compute(self):
            return sum(self.values) / len(self.values)

        def reset(self):
            self.values = []

    mean = Mean()
    mean.update(torch.tensor([1.0, 3.0]), None)
    mean.dist_reduce()  # the base hook does nothing
    assert mean.values == [2.0] and reduce_and_compute(mean) == 2.0


def test_metric_to_moves_its_tensors():
    metric = Accuracy().to("meta")
    assert metric.correct.device.type == "meta" and metric.total.device.type == "meta"


def test_all_reduce_sum_is_a_no_op_without_a_process_group():
    assert not dist.is_initialized()
    a, b = torch.tensor([1.0, 2.0]), torch.tensor(5)
    all_reduce_sum_(a, b)
    assert torch.equal(a, torch.tensor([1.0, 2.0])) and b.item() == 5


def _rank(rank: int, world: int, store_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world)
    try:
        counts = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
        all_reduce_sum_(counts)
        # Each rank sees a different shard; the reduced metric is the global one.
        metric = Accuracy()
        if rank == 0:
            metric.update(torch.eye(4), torch.tensor([0, 1, 2, 0]))  # 3 of 4 right
        else:
            metric.update(torch.eye(2), torch.tensor([1, 1]))  # 1 of 2 right
        value = reduce_and_compute(metric)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"counts": counts.tolist(), "accuracy": value}, f)
    finally:
        dist.destroy_process_group()


def test_all_reduce_sum_and_dist_reduce_across_two_gloo_processes(tmp_path):
    mp.start_processes(_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["counts"] == [3.0, 30.0]
        assert result["accuracy"] == pytest.approx(4 / 6)


def test_usable_metrics_are_recognised():
    import torchmetrics

    assert is_usable_metric(Accuracy())
    assert is_usable_metric(torchmetrics.classification.MulticlassAccuracy(num_classes=3))
    assert not is_usable_metric(Accuracy)  # the class, not an object
    assert not is_usable_metric(torch.nn.MSELoss())


CUSTOM_METRICS = '''
import torch

from echelon3.metrics.base import Metric, all_reduce_sum_


class Accuracy(Metric):
    def __init__(self):
        self.correct = torch.zeros(())
        self.total = torch.zeros(())

    def update(self, preds, target):
        self.correct += (preds.argmax(-1) == target).sum()
        self.total += target.numel()

    def dist_reduce(self):
        all_reduce_sum_(self.correct, self.total)

    def compute(self):
        return self.correct / self.total

    def reset(self):
        self.correct.zero_()
        self.total.zero_()


class OneArgument:
    """Has the methods, but update cannot take (preds, target)."""

    def update(self, preds):
        pass

    def compute(self):
        return 0.0

    def reset(self):
        pass


def metric_class():
    """A factory that returns a class instead of a metric."""
    return Accuracy
'''

TORCHMETRICS_ACCURACY = {"module": "torchmetrics.classification", "type": "MulticlassAccuracy",
                         "config": {"num_classes": 10, "average": "micro"}}


def test_a_custom_metric_in_a_run_matches_torchmetrics(tmp_path):
    (tmp_path / "my_metrics.py").write_text(CUSTOM_METRICS)
    write_config(tmp_path, {"metrics": [
        {"accuracy": TORCHMETRICS_ACCURACY},
        {"counted": {"module": "my_metrics.py", "type": "Accuracy"}},
    ], "trainer": {"config": {"keep_best_on": "counted"}}})
    assert echelon3("train", tmp_path) == 0
    for record in history(target(tmp_path), "val"):
        assert record["counted"] == pytest.approx(record["accuracy"], abs=1e-6)
    assert echelon3("evaluate", tmp_path) == 0
    metrics = json.loads((target(tmp_path) / "metrics.json").read_text())
    assert metrics["counted"] == pytest.approx(metrics["accuracy"], abs=1e-6)


@pytest.mark.parametrize("spec", [
    {"module": "torch.nn", "type": "MSELoss"},
    {"module": "my_metrics.py", "type": "OneArgument"},
    {"module": "my_metrics.py", "type": "metric_class"},
])
@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_an_unusable_metric_is_rejected_when_the_run_is_built(tmp_path, capsys, spec, command):
    (tmp_path / "my_metrics.py").write_text(CUSTOM_METRICS)
    write_config(tmp_path, {"metrics": [{"accuracy": TORCHMETRICS_ACCURACY},
                                        {"broken": spec}]})
    if command == "evaluate":  # past the launcher's "no checkpoint to load" (tasks/early.py)
        target(tmp_path).mkdir(parents=True)
        (target(tmp_path) / "best.tar").write_bytes(b"")
    assert echelon3(command, tmp_path) == 2
    err = capsys.readouterr().err
    assert "metrics.broken" in err
    out = target(tmp_path)
    assert not (out / "history.jsonl").exists()
    assert not list(out.glob("checkpoint-*.tar"))
