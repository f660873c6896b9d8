"""Configs brought from other tools: callables passed with ``partial: true``, tensors written
as lists, and networks with two named outputs trained, validated, resumed and evaluated
(1 rank and 2 gloo ranks, bf16 autocast), each compared with torch computing the same."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.data import DistributedSampler, default_collate

from echelon3.config.build import instantiate
from echelon3.config.errors import BuildError, UserError
from echelon3.data.batches import Keyed, weighted_loss
from echelon3.data.loaders import create_dataloader
from echelon3.datasets.digits_heads import DigitsParity
from echelon3.metrics.adapters import FunctionMetric
from echelon3.nets.heads import TwoHeadMLP
from echelon3.tasks.components import build_losses, build_metrics
from echelon3.trainers.evaluation import update
from tests import helpers
from tests.conftest import run_cli

PAD = '''import torch


def pad_collate(batch, value=0.0):
    """(sequence, label) samples of different lengths -> (padded [B, T], labels)."""
    longest = max(len(x) for x, _ in batch)
    padded = torch.full((len(batch), longest), value)
    for row, (x, _) in enumerate(batch):
        padded[row, :len(x)] = x
    return padded, torch.tensor([y for _, y in batch])
'''


def cfg(**sections):
    return OmegaConf.create(sections)


# --------------------------------------------------------------------------- partial: true

def test_partial_collate_fn_is_passed_to_the_loader_and_pads_batches(tmp_path):
    (tmp_path / "pads.py").write_text(PAD)
    lengths = [3, 1, 4, 2, 5]
    samples = [(torch.arange(1.0, n + 1), n % 2) for n in lengths]
    collate = {"module": "pads.py", "type": "pad_collate", "partial": True,
               "config": {"value": -1.0}}
    spec = {"module": "torch.utils.data", "type": "DataLoader",
            "config": {"batch_size": 5, "collate_fn": collate}}
    loader = create_dataloader("test", spec, samples, train=False, rank=0, world_size=1,
                               seed=0, config_dir=tmp_path)
    inputs, labels = next(iter(loader))
    expected = torch.nn.utils.rnn.pad_sequence([x for x, _ in samples], batch_first=True,
                                               padding_value=-1.0)
    assert torch.equal(inputs, expected) and labels.tolist() == [1, 1, 0, 0, 1]
    # Without config the function itself; called without its argument, one line with the hint.
    bare = instantiate({k: v for k, v in collate.items() if k != "config"}, "x", tmp_path)
    assert bare.__name__ == "pad_collate" and not isinstance(bare, functools.partial)
    del collate["partial"]
    with pytest.raises(BuildError) as err:
        create_dataloader("test", spec, samples, train=False, rank=0, world_size=1, seed=0,
                          config_dir=tmp_path)
    assert str(err.value) == (
        "dataloaders.test.config.collate_fn: pad_collate is called when built, but it requires "
        "'batch'; to pass the function itself (bound to its config), not what it returns, add "
        "'partial: true' to dataloaders.test.config.collate_fn")


def test_partial_functional_loss_and_list_class_weights_equal_torch():
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(12, 4, generator=g), torch.arange(12) % 4
    weights = [1.0, 3.0, 0.5, 2]
    losses = build_losses(cfg(loss=[
        {"smooth": {"module": "torch.nn.functional", "type": "cross_entropy", "partial": True,
                    "config": {"label_smoothing": 0.1}, "weight": 0.5}},
        {"listed": {"module": "torch.nn", "type": "CrossEntropyLoss",
                    "config": {"weight": weights}}},
        {"triple": {"module": "torch.nn.functional", "type": "cross_entropy", "partial": True,
                    "config": {"weight": {"module": "torch", "type": "tensor",
                                          "config": {"data": weights}}}}}]))
    total, parts = weighted_loss(losses, logits, target)
    w = torch.tensor(weights)
    assert torch.equal(parts["smooth"], F.cross_entropy(logits, target, label_smoothing=0.1))
    assert torch.equal(parts["listed"], F.cross_entropy(logits, target, weight=w))
    assert torch.equal(parts["triple"], F.cross_entropy(logits, target, weight=w))
    assert torch.allclose(total, 0.5 * parts["smooth"] + 2 * parts["listed"], atol=1e-6)
    # Stateful losses go where the network goes: a module's buffer, a partial's tensor.
    moved = build_losses(cfg(loss=[{"m": {"module": "torch.nn", "type": "CrossEntropyLoss",
                                          "config": {"weight": weights}}},
                                   {"p": losses_spec(weights)}]),
                         device=torch.device("meta"))
    assert moved["m"][0].weight.device.type == "meta"
    assert moved["p"][0].keywords["weight"].device.type == "meta"


def losses_spec(weights):
    return {"module": "torch.nn.functional", "type": "cross_entropy", "partial": True,
            "config": {"weight": {"module": "torch", "type": "tensor",
                                  "config": {"data": weights}}}}


def test_metric_function_is_the_sample_mean_over_uneven_batches():
    metrics = build_metrics(cfg(metrics=[{"acc": {
        "module": "torchmetrics.functional.classification", "type": "multiclass_accuracy",
        "partial": True, "config": {"num_classes": 3, "average": "micro"}}}]))
    assert isinstance(metrics["acc"], FunctionMetric)
    g = torch.Generator().manual_seed(1)
    preds, target = torch.randn(15, 3, generator=g), torch.randint(0, 3, (15,), generator=g)
    for lo, hi in ((0, 5), (5, 8), (8, 15)):
        metrics["acc"].update(preds[lo:hi], target[lo:hi])
    exact = (preds.argmax(1) == target).double().mean()
    assert torch.allclose(metrics["acc"].compute(), exact, atol=1e-12)


def test_mapping_outputs_name_the_key_to_set():
    out = {"cls": torch.randn(4, 3), "aux": torch.randn(4, 1)}
    target = torch.tensor([0, 2, 1, 0])
    plain = {"ce": (torch.nn.CrossEntropyLoss(), 1.0)}
    with pytest.raises(UserError, match=r"^loss\.ce\.input_key: the network returns a mapping "
                                        r"\(keys cls, aux\)"):
        weighted_loss(plain, out, target)
    metrics = build_metrics(cfg(metrics=[{"acc": {
        "module": "torchmetrics.classification", "type": "MulticlassAccuracy",
        "config": {"num_classes": 3}}}]))
    with pytest.raises(UserError, match=r"^metrics\.acc\.input_key: the network returns"):
        update(metrics, out, target)
    wrong = {"ce": (Keyed(torch.nn.CrossEntropyLoss(), "kls", None, "loss.ce"), 1.0)}
    with pytest.raises(UserError, match=r"^loss\.ce\.input_key: 'kls' is not among the network "
                                        r"output's keys \(cls, aux\)"):
        weighted_loss(wrong, out, target)
    keyed = {"ce": (Keyed(torch.nn.CrossEntropyLoss(), "cls", None, "loss.ce"), 1.0)}
    assert torch.equal(weighted_loss(keyed, out, target)[0],
                       F.cross_entropy(out["cls"], target))


# --------------------------------------------------------------------------- two heads, end to end

HEADS = {
    "net": {"module": "echelon3.nets.heads", "type": "TwoHeadMLP",
            "config": {"hidden": 16, "dropout": 0.0}},
    "data": {"train": {"module": "echelon3.datasets.digits_heads", "type": "DigitsParity"},
             "test": {"module": "echelon3.datasets.digits_heads", "type": "DigitsParity"}},
    "loss": [{"digit": {"module": "torch.nn", "type": "CrossEntropyLoss",
                        "input_key": "digit", "target_key": "digit"}},
             {"parity": {"module": "torch.nn.functional", "type": "cross_entropy",
                         "partial": True, "config": {"label_smoothing": 0.1},
                         "input_key": "parity", "target_key": "parity", "weight": 0.5}}],
    "metrics": [{"accuracy": {"module": "torchmetrics.classification",
                              "type": "MulticlassAccuracy",
                              "config": {"num_classes": 10, "average": "micro"},
                              "input_key": "digit", "target_key": "digit"}},
                {"parity_accuracy": {"module": "torchmetrics.functional.classification",
                                     "type": "multiclass_accuracy", "partial": True,
                                     "config": {"num_classes": 2, "average": "micro"},
                                     "input_key": "parity", "target_key": "parity"}}],
    "trainer": {"config": {"epochs": 1, "precision": "bf16"}},
    "export": {"preprocess": "dataset", "postprocess": {
        "module": "echelon3.nets.heads", "type": "PickOutput", "config": {"key": "digit"}}},
}


def write(folder: Path) -> Path:
    return helpers.write_config(folder, HEADS, remove=("scheduler",))


def sets():
    return (DigitsParity(split="train", limit=helpers.TRAIN_LIMIT),
            DigitsParity(split="test", limit=helpers.TEST_LIMIT))


def total_loss(out, y):
    return F.cross_entropy(out["digit"], y["digit"]) + 0.5 * F.cross_entropy(
        out["parity"], y["parity"], label_smoothing=0.1)


def hand_trained(world: int, epochs: int = 1) -> TwoHeadMLP:
    """SGD on the two heads, each of ``world`` ranks' shards under bf16 autocast, gradients
    averaged over the ranks: what DDP does, written out."""
    torch.manual_seed(0)
    net = TwoHeadMLP(hidden=16)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    train, _ = sets()
    per_rank = 32 // world
    for epoch in range(epochs):
        orders = []
        for rank in range(world):
            sampler = DistributedSampler(train, world, rank, shuffle=True, seed=0,
                                         drop_last=True)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for step in range(len(orders[0]) // per_rank):
            grads = []
            for order in orders:
                x, y = default_collate([train[i] for i in order[step * per_rank:
                                                                (step + 1) * per_rank]])
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = total_loss(net(x), y)
                net.zero_grad()
                loss.backward()
                grads.append([p.grad.clone() for p in net.parameters()])
            for p, *each in zip(net.parameters(), *grads):
                p.grad = sum(each) / world
            optimizer.step()
    return net


@torch.no_grad()
def hand_scores(net, world: int = 1, bf16: bool = False) -> dict[str, float]:
    """Loss and both accuracies over the test set, sharded by stride as echelon3 does."""
    _, test = sets()
    net.eval()
    loss, right, even_right = 0.0, 0, 0
    for rank in range(world):
        shard = list(range(rank, len(test), world))
        for lo in range(0, len(shard), 64 // world):
            x, y = default_collate([test[i] for i in shard[lo:lo + 64 // world]])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = net(x)
                loss += float(total_loss(out, y).double() * len(x))
            right += int((out["digit"].float().argmax(1) == y["digit"]).sum())
            even_right += int((out["parity"].float().argmax(1) == y["parity"]).sum())
    n = len(test)
    return {"loss": loss / n, "accuracy": right / n, "parity_accuracy": even_right / n}


def state(path: Path) -> dict:
    return helpers.load(path)["model_state_dict"]


def assert_close_states(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=atol), (key, (a[key] - b[key]).abs().max())


def assert_scores(record: dict, expected: dict) -> None:
    assert record["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
    assert record["parity_accuracy"] == pytest.approx(expected["parity_accuracy"], abs=1e-6)
    assert record["loss"] == pytest.approx(expected["loss"], rel=1e-5)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """One rank: 1 epoch, evaluate, resumed to 2 epochs; and 2 epochs straight."""
    resumed, straight = tmp_path_factory.mktemp("resumed"), tmp_path_factory.mktemp("straight")
    write(resumed), write(straight)
    assert helpers.echelon3("train", resumed) == 0
    first = state(helpers.target(resumed) / "checkpoint-1.tar")
    validated = helpers.history(helpers.target(resumed))[-1]
    assert helpers.echelon3("evaluate", resumed) == 0
    evaluated = json.loads((helpers.target(resumed) / "metrics.json").read_text())
    best = state(helpers.target(resumed) / "best.tar")
    assert helpers.echelon3("train", resumed, "trainer.config.epochs=2") == 0
    assert helpers.echelon3("train", straight, "trainer.config.epochs=2") == 0
    return {"folder": resumed, "first": first, "validated": validated, "evaluated": evaluated,
            "best": best, "resumed": state(helpers.target(resumed) / "checkpoint-2.tar"),
            "straight": state(helpers.target(straight) / "checkpoint-2.tar")}


def test_two_heads_train_and_validate_as_a_hand_written_bf16_loop(heads):
    net = hand_trained(world=1)
    assert_close_states(heads["first"], net.state_dict(), atol=1e-6)
    assert heads["validated"]["split"] != "train"
    assert_scores(heads["validated"], hand_scores(net, bf16=True))


def test_two_heads_resume_equals_uninterrupted_and_evaluate_scores_the_checkpoint(heads):
    helpers.assert_same_tensors(heads["resumed"], heads["straight"])
    net = TwoHeadMLP(hidden=16)
    net.load_state_dict(heads["best"])
    assert_scores(heads["evaluated"], hand_scores(net))  # evaluate: fp32 on the CPU


def test_two_heads_export_one_output_and_predict_scores_it(heads, capsys):
    folder = heads["folder"]
    assert helpers.echelon3("export", folder, "~export.postprocess") == 2
    assert "export.postprocess: the network returns a mapping (keys digit, parity) and " \
        "model.onnx holds one output" in capsys.readouterr().err
    assert helpers.echelon3("export", folder) == 0
    contract = json.loads((helpers.target(folder) / "model.json").read_text())
    assert contract["output_key"] == "digit" and contract["output"]["shape"] == ["batch", 10]
    assert helpers.echelon3("predict", folder, "~metrics.1") == 0
    assert helpers.echelon3("evaluate", folder) == 0  # the same checkpoint (now epoch 2's)
    scored = json.loads((helpers.target(folder) / "model.metrics.json").read_text())
    evaluated = json.loads((helpers.target(folder) / "metrics.json").read_text())
    assert scored["accuracy"] == pytest.approx(evaluated["accuracy"], abs=1e-6)


@torch.no_grad()
def test_two_heads_run_writes_the_named_output(heads, capsys):
    folder = heads["folder"]
    assert helpers.echelon3("run", folder) == 2
    assert "runner.output_key: the network returns a mapping (keys digit, parity); name the " \
        "entry to write" in capsys.readouterr().err
    assert helpers.echelon3("run", folder, "+runner.config.output_key=parity") == 0
    rows = (helpers.target(folder) / "predictions.csv").read_text().splitlines()
    assert rows[0] == "index,prediction,score_0,score_1"
    net = TwoHeadMLP(hidden=16)
    net.load_state_dict(state(helpers.target(folder) / "best.tar"))
    _, test = sets()
    x, _ = default_collate([test[i] for i in range(len(test))])
    expected = net.eval()(x)["parity"].argmax(1).tolist()
    assert [int(row.split(",")[1]) for row in rows[1:]] == expected


def test_two_heads_on_two_gloo_ranks_under_bf16(tmp_path):
    """Sharded training and exact validation of a mapping output on 2 ranks."""
    write(tmp_path)
    result = run_cli(["train", "-cd", str(tmp_path), "-cn", "run", "nproc=2"], timeout=240)
    assert result.returncode == 0, result.stderr
    net = hand_trained(world=2)
    assert_close_states(state(helpers.target(tmp_path) / "checkpoint-1.tar"), net.state_dict(),
                        atol=1e-6)
    assert_scores(helpers.history(helpers.target(tmp_path))[-1],
                  hand_scores(net, world=2, bf16=True))
