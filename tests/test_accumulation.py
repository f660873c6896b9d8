"""Gradient accumulation: N micro-batches of B equal one batch of N x B, in 1 and 2 ranks.

fp32, plain SGD, no dropout, batches in order: the only difference between the
runs is the order of float additions, so weights agree to float tolerance.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from echelon3.config.errors import ConfigError
from echelon3.distributed import preemption
from echelon3.distributed.precision import Precision
from echelon3.nets.mlp import MLP
from echelon3.trainers.nonfinite import NonFiniteGuard
from echelon3.trainers.stepping import Stepping
from tests.conftest import run_cli
from tests.helpers import (assert_same_tensors, blobs, echelon3, history, load, loader,
                           make_trainer, write_config)

TOLERANCE = 1e-6  # |w_accumulated - w_big_batch|, float32 summation order


def test_windows_cover_the_epoch_and_scale_by_their_size():
    acc = Stepping(3, NonFiniteGuard(), Precision("fp32", torch.device("cpu")), list)
    windows = [acc.window(i, 7) for i in range(7)]
    assert [last for _, last in windows] == [False, False, True, False, False, True, True]
    assert [scale for scale, _ in windows] == [1 / 3] * 6 + [1.0]  # the last window holds 1


def test_accumulated_micro_batches_equal_one_big_batch(tmp_path):
    inputs, labels = blobs(64)
    runs = {}
    for batch, accum in ((8, 4), (32, 1)):
        trainer = make_trainer(tmp_path / f"b{batch}", epochs=2, grad_accum_steps=accum,
                               train_loader=loader(inputs, labels, batch_size=batch))
        trainer.fit()
        assert trainer.global_step == 4  # optimizer steps: 2 per epoch in both runs
        steps = [r["step"] for r in trainer.logger.split("val")]
        assert steps == [2, 4]
        runs[accum] = trainer.net.state_dict()
    for key, value in runs[1].items():
        assert torch.allclose(runs[4][key], value, rtol=0, atol=TOLERANCE), key
    assert not torch.equal(runs[4]["weight"], make_trainer(tmp_path / "x").net.weight)


def test_closure_optimizer_with_accumulation_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="trainer.config.grad_accum_steps: must be 1 with a "
                                          "closure optimizer"):
        make_trainer(tmp_path, optimizer=lambda p: torch.optim.LBFGS(p), grad_accum_steps=2)
    with pytest.raises(ConfigError, match="trainer.config.grad_accum_steps: must be a positive"):
        make_trainer(tmp_path, grad_accum_steps=0)


PREEMPT_AT = "ECHELON3_TEST_PREEMPT_AT"  # outside the config: the resumed run is the same run


class PreemptingMLP(MLP):
    """The digits MLP; rank 0 sends itself SIGUSR1 (a preemption notice) in its
    ``$ECHELON3_TEST_PREEMPT_AT``-th training forward, so the run checkpoints after
    that micro-batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.at, self.calls = int(os.environ.get(PREEMPT_AT, 0)), 0

    def forward(self, x):
        self.calls += self.training
        if self.calls == self.at and int(os.environ.get("RANK", 0)) == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        return super().forward(x)


def preempting(dropout: float = 0.1, **trainer) -> dict:
    """192 samples, batch 32: 6 micro-batches per epoch, windows of 3; momentum SGD."""
    return {"net": {"module": "tests.test_accumulation", "type": "PreemptingMLP",
                    "config": {"hidden": 32, "dropout": dropout}},
            "trainer": {"config": {"grad_accum_steps": 3, "precision": "fp32", **trainer}}}


def test_preempted_in_the_middle_of_a_window_resumes_exactly(tmp_path, own_handlers,
                                                            monkeypatch):
    straight, split = tmp_path / "straight", tmp_path / "split"
    write_config(straight, preempting())
    write_config(split, preempting())
    assert echelon3("train", straight) == 0
    monkeypatch.setenv(PREEMPT_AT, str(6 + 5))  # epoch 2, micro-batch 5: 2 of 3 in the window
    assert echelon3("train", split) == preemption.RESUBMIT_EXIT
    monkeypatch.delenv(PREEMPT_AT)
    (mid,) = (split / "out").glob("checkpoint-1-step*.tar")
    state = load(mid)
    (mine,) = state["mid_epoch"]["ranks"]
    assert state["global_step"] == 3 and mine["position"]["step"] == 5
    assert len(mine["stepping"]["losses"]) == 2 and len(mine["stepping"]["grads"]) == 4
    preemption.reset()
    assert echelon3("train", split) == 0
    assert_same_tensors(load(split / "out" / "checkpoint-2.tar")["model_state_dict"],
                        load(straight / "out" / "checkpoint-2.tar")["model_state_dict"])


def test_two_ranks_accumulating_equal_one_process_with_the_whole_batch(tmp_path):
    """2 ranks x 2 micro-batches of 8 (global 16) == 1 process, batch 32, gradient clipping
    on. The 2-rank run is
    preempted (ranks agree at a log point, so at a window's end) and resumed, and DDP's
    static graph is on, so its first iteration syncs inside a window (an all-reduce more):
    neither may change the result."""
    plain = {"net": {"config": {"dropout": 0.0}}, "optimizer": {"config": {"momentum": 0.0}},
             "dataloaders": {"train": {"config": {"shuffle": False}}},
             "trainer": {"config": {"epochs": 1, "precision": "fp32", "log_every_n_steps": 1,
                                    "gradient_clip_val": 0.5}}}
    ranks = tmp_path / "ranks"
    write_config(ranks, {**plain, **preempting(0.0, epochs=1, grad_accum_steps=2,
                                                ddp_static_graph=True, log_every_n_steps=1,
                                                ddp_find_unused_parameters=False,
                                                gradient_clip_val=0.5),
                         "dataloaders": {"train": {"config": {"shuffle": False,
                                                              "batch_size": 16}}}},
                 remove=("scheduler",))
    args = ["train", "-cd", str(ranks), "-cn", "run", "nproc=2"]
    result = run_cli(args, env={PREEMPT_AT: "5"}, timeout=240)
    assert result.returncode == preemption.RESUBMIT_EXIT, result.stderr[-3000:]
    (mid,) = (ranks / "out").glob("checkpoint-0-step*.tar")
    # The signal in micro-batch 5 joins step 3's log point, read at step 4's: all stop there.
    state = load(mid)
    assert state["global_step"] == 4
    assert [r["stepping"] for r in state["mid_epoch"]["ranks"]] == [{}, {}]
    result = run_cli(args, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    single = tmp_path / "single"
    write_config(single, plain, remove=("scheduler",))
    assert echelon3("train", single) == 0
    a = load(ranks / "out" / "checkpoint-1.tar")
    b = load(single / "out" / "checkpoint-1.tar")
    assert a["global_step"] == b["global_step"] == 192 // 32
    for key, value in b["model_state_dict"].items():
        assert torch.allclose(a["model_state_dict"][key], value, rtol=0, atol=TOLERANCE), key
    # Clipping acted (norms above 0.5) alike on both: the ranks' averaged gradients.
    norms = [[r["grad_norm"] for r in history(run / "out", "train")] for run in (ranks, single)]
    assert len(norms[0]) == 6 and max(norms[1]) > 0.5
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)
    # Every record's samples/s x its time is the step's 32 samples, summed over both ranks'
    # 2 micro-batches of 8 (the step's time: step_ms, one step per record), also resumed.
    for run in (ranks, single):
        seen = [r["samples_per_s"] * r["step_ms"] / 1e3 for r in history(run / "out", "train")]
        assert seen == pytest.approx([32] * 6, rel=1e-9)


def test_ddp_all_reduces_once_per_window(tmp_path):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from tests.helpers import single_rank_group

    calls = []

    def counting(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    with single_rank_group(tmp_path):
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(4, 3))
        model.register_comm_hook(None, counting)
        trainer = make_trainer(tmp_path, net=model, grad_accum_steps=3, epochs=1,
                               train_loader=loader(*blobs(64), batch_size=8))
        trainer.fit()
    assert trainer.global_step == 3  # 8 micro-batches: windows of 3, 3 and 2
    assert len(calls) == 3  # one bucket, all-reduced once per window


def test_a_skipped_non_finite_micro_batch_drops_its_window(tmp_path):
    class NaNOnSecondBatch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.calls = torch.nn.Linear(4, 3), 0

        def forward(self, x):
            self.calls += self.training
            return self.fc(x) * (float("nan") if self.calls == 2 else 1.0)

    trainer = make_trainer(tmp_path, net=NaNOnSecondBatch(), grad_accum_steps=2, epochs=1,
                           nan_policy="skip", train_loader=loader(*blobs(64), batch_size=8))
    trainer.fit()
    assert trainer.nonfinite.skipped == 1
    assert all(torch.isfinite(p).all() for p in trainer.net.parameters())
    assert trainer.global_step == 4  # the dropped window keeps its slot, as a skipped step does
