"""Buffers have one owner: rank 0. A BatchNorm net trained on 2 ranks (DDP and FSDP)
validates with the buffers best.tar holds, so the record that chose best.tar equals
``evaluate`` of best.tar in one process, and a sharded checkpoint holds the same buffers."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import PROBE, run_cli
from tests.helpers import history, write_config
from tests.test_fsdp import sharded_state

TIMEOUT = 240


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def trained(request, tmp_path_factory):
    """One epoch of a BatchNorm net on 2 gloo ranks, then evaluate of best.tar in one
    process on the same (test) set."""
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
    done = run_cli(["evaluate", *args, "nproc=1"], timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return request.param, folder / "out"


def test_the_record_that_chose_best_tar_is_what_best_tar_scores(trained):
    _, out = trained
    (record,) = history(out, "val")
    scored = json.loads((out / "metrics.json").read_text())
    assert scored["accuracy"] == pytest.approx(record["accuracy"], abs=1e-6)
    assert scored["loss"] == pytest.approx(record["loss"], rel=1e-5)


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
