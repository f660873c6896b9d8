"""Buffers have one owner: rank 0. A BatchNorm net trained on 2 ranks (DDP and FSDP)
validates with the buffers best.tar holds, so the record that chose best.tar equals
best.tar scored in this process by hand, and a sharded checkpoint holds the same buffers."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import PROBE, run_cli
from tests.helpers import TEST_LIMIT, history, write_config
from tests.test_fsdp import sharded_state

TIMEOUT = 240


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def trained(request, tmp_path_factory):
    """One epoch of a BatchNorm net on 2 gloo ranks, validated on the test set."""
    folder = tmp_path_factory.mktemp(f"bn-{request.param}")
    write_config(folder, {"net": {"module": str(PROBE), "type": "BatchNormNet", "config": {}},
                          "strategy": request.param, "trainer": {"config": {"epochs": 1}},
                          "scheduler": None, "optimizer": {"module": "torch.optim",
                                                           "type": "AdamW",
                                                           "config": {"lr": 0.01}}},
                 remove=("net", "optimizer"))
    args = ["-cd", str(folder), "-cn", "run"]
    done = run_cli(["train", *args, "nproc=2"], timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return request.param, folder / "out"


def test_the_record_that_chose_best_tar_is_what_best_tar_scores(trained):
    """Scored here, by hand: the net with best.tar's weights and buffers, in eval mode,
    over the whole test set in one batch."""
    from echelon3.datasets.digits import Digits
    from tests.probe import BatchNormNet

    _, out = trained
    (record,) = history(out, "val")
    net = BatchNormNet()
    net.load_state_dict(torch.load(out / "best.tar", weights_only=True)["model_state_dict"])
    data = Digits(split="test", limit=TEST_LIMIT)
    inputs = torch.stack([data[i][0] for i in range(len(data))])
    labels = torch.tensor([int(data[i][1]) for i in range(len(data))])
    with torch.no_grad():
        logits = net.eval()(inputs)
    accuracy = (logits.argmax(1) == labels).double().mean().item()
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    assert accuracy == pytest.approx(record["accuracy"], abs=1e-6)
    assert loss == pytest.approx(record["loss"], rel=1e-5)


def test_the_epoch_checkpoint_holds_best_tars_buffers(trained, tmp_path):
    strategy, out = trained
    best = torch.load(out / "best.tar", weights_only=True)["model_state_dict"]
    if strategy == "fsdp":
        saved = sharded_state(out / "checkpoint-1.dcp", tmp_path)["model_state_dict"]
    else:
        saved = torch.load(out / "checkpoint-1.tar", weights_only=True)["model_state_dict"]
    buffers = [k for k in best if "running_" in k or "num_batches" in k]
    assert buffers, sorted(best)
    for key in buffers:
        assert torch.equal(saved[key], best[key]), key


def test_the_averages_buffers_come_in_the_same_order_on_every_rank():
    """They are broadcast one by one, so their order must not depend on the process (a set
    of names would follow each process's string hashing)."""
    from echelon3.trainers.ema import EMA

    net = torch.nn.Sequential(*(torch.nn.BatchNorm1d(4) for _ in range(5)))
    ema = EMA(net, {"decay": 0.9})
    names = [name for name in net.state_dict() if name in dict(net.named_buffers())]
    assert len(names) == 15
    assert [id(t) for t in ema.buffers()] == [id(ema.average[name]) for name in names]
