"""``loss: from_output``: a network that computes its own loss from the target.

Each check compares with the same network trained through a configured loss (the
same weights, the same data): the records, the validation and the final weights agree.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from echelon3.config.errors import ConfigError, UserError
from echelon3.data.batches import OutputLoss, call_net, predictions, weighted_loss
from echelon3.nets.mlp import MLP
from tests.helpers import (echelon3, history, make_trainer, single_rank_group, target,
                           without_clock, write_config)


class Output:
    """An object with attributes, as transformers' ``ModelOutput`` reads."""

    def __init__(self, loss, logits):
        self.loss, self.logits = loss, logits


class OwnLoss(torch.nn.Module):
    """A linear classifier that returns its output in the form ``form`` says."""

    def __init__(self, form: str = "tuple"):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.form = form

    def forward(self, x, target=None):
        logits = self.linear(x)
        if target is None:
            return logits
        loss = F.cross_entropy(logits, target)
        return {"tuple": (logits, loss), "object": Output(loss, logits),
                "tensor": loss}[self.form]


class Labelled(torch.nn.Module):
    """transformers-style: ``forward(input_ids, attention_mask=None, labels=None)`` -> mapping."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x, attention_mask=None, labels=None):
        logits = self.linear(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def _fit(tmp_path: Path, net, losses, **settings):
    trainer = make_trainer(tmp_path, net=net, losses=losses, epochs=2, log_every_n_steps=1,
                           **settings)
    trainer.fit()
    return trainer


def _reference(tmp_path: Path, **settings):
    torch.manual_seed(0)
    return _fit(tmp_path / "reference", torch.nn.Linear(4, 3), None, **settings)


def _own(tmp_path: Path, make, **settings):
    torch.manual_seed(0)
    net = make()
    return _fit(tmp_path / "own", net, OutputLoss(), **settings)


def _same_run(own, reference, metrics: bool = True) -> None:
    keys = ("split", "epoch", "step", "loss", *(("accuracy",) if metrics else ()))
    mine = [{k: r.get(k) for k in keys} for r in own.logger.records if r["split"] != "time"]
    theirs = [{k: r.get(k) for k in keys} for r in reference.logger.records
              if r["split"] != "time"]
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == (pytest.approx(b[k], rel=1e-6) if isinstance(b[k], float) else b[k]), k
    plain = own.net.linear if hasattr(own.net, "linear") else own.net.module.linear
    assert torch.allclose(plain.weight, reference.net.weight, atol=1e-6)


@pytest.mark.parametrize("make", [OwnLoss, Labelled, lambda: OwnLoss("object")],
                         ids=["tuple", "labels-mapping", "object"])
@pytest.mark.parametrize("settings", [{}, {"grad_accum_steps": 2}, {"precision": "bf16"}],
                         ids=["plain", "accumulated", "autocast"])
def test_the_models_own_loss_trains_and_validates_like_the_configured_loss(tmp_path, make,
                                                                           settings):
    own = _own(tmp_path, make, **settings)
    _same_run(own, _reference(tmp_path, **settings))
    train = [r for r in without_clock(own.logger.records) if r["split"] == "train"]
    assert train and set(train[0]) == {"split", "epoch", "step", "lr", "loss"}  # no parts


def test_a_model_that_returns_only_its_loss_trains_without_metrics(tmp_path):
    own = _own(tmp_path, lambda: OwnLoss("tensor"), metrics={}, keep_best_on="loss",
               high_is_better=False)
    _same_run(own, _reference(tmp_path, metrics={}, keep_best_on="loss",
                              high_is_better=False), metrics=False)


def test_metrics_need_logits(tmp_path):
    with pytest.raises(UserError, match="without logits"):
        _own(tmp_path, lambda: OwnLoss("tensor"))


def test_the_wrapper_is_called_not_the_module(tmp_path):
    """Under DDP the call goes through the wrapper (so gradients sync), decided on the module."""
    from torch.nn.parallel import DistributedDataParallel

    with single_rank_group(tmp_path):
        torch.manual_seed(0)
        own = _fit(tmp_path / "own", DistributedDataParallel(OwnLoss()), OutputLoss())
        _same_run(own, _reference(tmp_path))


def test_how_the_target_is_handed_over_is_read_from_the_signature():
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    for net, keyword in ((OwnLoss(), None), (Labelled(), "labels")):
        losses = OutputLoss()
        out = call_net(net, net, losses, x, y)
        assert losses.keyword == keyword
        total, parts = weighted_loss(losses, out, y)
        logits = predictions(losses, out)
        assert parts == {} and torch.equal(logits, net.linear(x))
        assert torch.allclose(total, F.cross_entropy(logits, y))
    with pytest.raises(ConfigError, match=r"^loss: is from_output, but MLP.forward\(x\) takes "
                                          "no target"):
        call_net(MLP(), MLP(), OutputLoss(), torch.randn(2, 64), torch.tensor([0, 1]))
    with pytest.raises(UserError, match="without a loss tensor"):
        OutputLoss.loss({"logits": x})


OWN_LOSS_NET = '''
import torch.nn.functional as F

from echelon3.nets.mlp import MLP


class OwnLossMLP(MLP):
    def forward(self, x, target=None):
        logits = super().forward(x)
        return logits if target is None else (logits, F.cross_entropy(logits, target))
'''


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory):
    """The digits run twice: the configured loss, and the same MLP's own loss."""
    runs = {}
    for name, updates in (("configured", {}), ("own", {
            "loss": "from_output",
            "net": {"module": "own_net.py", "type": "OwnLossMLP"}})):
        folder = tmp_path_factory.mktemp(name)
        (folder / "own_net.py").write_text(OWN_LOSS_NET)
        write_config(folder, {**updates, "trainer": {"config": {"grad_accum_steps": 2}}},
                     remove=("loss",) if updates else ())
        assert echelon3("train", folder) == 0
        assert echelon3("evaluate", folder) == 0
        runs[name] = folder
    return runs


def test_a_run_through_the_cli_equals_the_configured_loss(digits_runs):
    own, configured = (history(target(digits_runs[k])) for k in ("own", "configured"))
    assert [r["split"] for r in own] == [r["split"] for r in configured]
    for a, b in zip(own, configured):
        for k in ("loss", "accuracy"):
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-5), (k, a, b)
    metrics = [json.loads((target(digits_runs[k]) / "metrics.json").read_text())
               for k in ("own", "configured")]
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], rel=1e-5)
    assert metrics[0]["accuracy"] == pytest.approx(metrics[1]["accuracy"], rel=1e-6)


def test_a_net_that_takes_no_target_is_a_config_error(tmp_path, capsys):
    write_config(tmp_path, {"loss": "from_output"}, remove=("loss",))
    assert echelon3("train", tmp_path) == 2
    err = capsys.readouterr().err
    assert "loss: is from_output, but MLP.forward(x) takes no target" in err


# --------------------------------------------------------------------------- two DDP ranks

def _rank(rank: int, port: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from tests.helpers import blobs, loader

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        net = DistributedDataParallel(OwnLoss())
        inputs, labels = blobs()
        trainer = make_trainer(Path(out) / f"rank{rank}", net=net, losses=OutputLoss(),
                               epochs=1, train_loader=loader(inputs[rank::2], labels[rank::2], 8))
        trainer.fit()
        torch.save(net.module.linear.state_dict(), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ddp_ranks_step_like_one_process_on_the_union(tmp_path):
    """Equal halves of every batch on two ranks: the synced gradient is the union's."""
    from tests.helpers import blobs, loader

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    inputs, labels = blobs()
    order = torch.cat([torch.arange(0, 64, 2).view(-1, 8), torch.arange(1, 64, 2).view(-1, 8)],
                      dim=1).reshape(-1)  # each step: rank 0's 8 samples, then rank 1's
    make_trainer(tmp_path / "one", net=net, epochs=1,
                 train_loader=loader(inputs[order], labels[order], 16)).fit()
    for state in ranks:
        assert torch.allclose(state["weight"], net.weight, atol=1e-6)
        assert torch.allclose(state["bias"], net.bias, atol=1e-6)
