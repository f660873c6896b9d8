"""The places where the trainer's features meet, one test per failure once reproduced:

1. a preemption after a NaN loss under ``nan_policy: stop`` saves nothing non-finite;
2. an fp16 checkpoint inside an accumulation window holds unscaled gradients, and a
   precision change while the window is open is refused with one line;
3. ``nan_policy: skip`` skips a poisoned window as a whole, wherever the NaN falls in it;
4. one train record per ``log_every_n_steps`` optimizer steps, strictly increasing;
5. loader workers: every sample is seeded from (seed, epoch, index), so which worker loads
   it does not matter, and a resume with (persistent) workers equals a straight run;
6. parameters without a gradient keep ``None`` through a mid-window checkpoint;
7. ``profile.stop_after`` keeps the last logging interval.
Plus the closure optimizers' declaration, and the collectives per step under DDP.
"""

from __future__ import annotations

import pytest
import torch

from echelon3.data.loaders import SeededDataset
from echelon3.distributed import preemption
from echelon3.optimizers.closure import is_closure_optimizer
from echelon3.optimizers.sam import SAMOptimizer
from tests.combo import NoisyBlobs
from tests.conftest import run_cli
from tests.helpers import blobs, echelon3, history, load, loader, make_trainer, same_nested
from tests.test_combinations import config, outcome


@pytest.fixture
def combo_env(monkeypatch, tmp_path, own_handlers):
    """Set the planted NaN / signal of tests.combo for in-process runs."""
    def plant(nan_at=0, signal_at=0, signal="USR1"):
        monkeypatch.setenv("COMBO_NAN_AT", str(nan_at))
        monkeypatch.setenv("COMBO_SIGNAL_AT", str(signal_at))
        monkeypatch.setenv("COMBO_SIGNAL", signal)
        monkeypatch.setenv("COMBO_MARKER", str(tmp_path / f"signalled-{signal_at}"))
        preemption.reset()
    return plant


def test_1_preemption_after_a_nan_under_stop_saves_nothing(tmp_path):
    config(tmp_path, "fp32", 1, "stop", 0, False)
    result = run_cli(["train", "-cd", str(tmp_path), "-cn", "run", "trainer.config."
                      "log_every_n_steps=50"],
                     env={"COMBO_NAN_AT": "3", "COMBO_SIGNAL_AT": "5", "COMBO_SIGNAL": "USR1",
                          "COMBO_MARKER": str(tmp_path / "signalled")})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "non-finite loss at epoch 1, step 3" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_2_fp16_window_checkpoint_is_unscaled_and_precision_change_refused(tmp_path,
                                                                            combo_env):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    for folder in (straight, cut):
        config(folder, "fp16", 3, "stop", 0, False)
    combo_env()
    assert echelon3("train", straight) == 0
    combo_env(signal_at=8)
    assert echelon3("train", cut) == preemption.RESUBMIT_EXIT
    (mid,) = (cut / "out").glob("checkpoint-1-step*.tar")
    state = load(mid)
    saved = state["mid_epoch"]["ranks"][0]["stepping"]
    assert saved["precision"] == "fp16" and len(saved["losses"]) == 2
    # Unscaled: the gradients of two micro-batches of a 4-16-3 net, not x the scale.
    assert state["scaler_state_dict"]["scale"] >= 2.0**10
    grads = [g for g in saved["grads"] if g is not None]
    assert max(float(g.abs().max()) for g in grads) < 10
    preemption.reset()
    assert echelon3("train", cut, "trainer.config.precision=fp32") == 2
    assert not list((cut / "out").glob("checkpoint-2.tar"))
    assert echelon3("train", cut) == 0
    a, b = outcome(straight / "out"), outcome(cut / "out")
    for key in ("weights", "optimizer", "scaler"):
        assert same_nested(a[key], b[key]), key


class NaNAt(torch.nn.Module):
    def __init__(self, at: int):
        super().__init__()
        self.fc, self.calls, self.at = torch.nn.Linear(4, 3), 0, at

    def forward(self, x):
        self.calls += self.training
        return self.fc(x) * (float("nan") if self.calls == self.at else 1.0)


@pytest.mark.parametrize("nan_at", [2, 3])  # the middle and the end of window 1
def test_3_skip_drops_a_poisoned_window_as_a_whole(tmp_path, nan_at):
    inputs, labels = blobs(48)
    net = NaNAt(nan_at)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    trainer = make_trainer(tmp_path, net=net, epochs=1, grad_accum_steps=3, nan_policy="skip",
                           log_every_n_steps=1, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                           train_loader=loader(inputs, labels, batch_size=8))
    trainer.fit()
    assert trainer.nonfinite.skipped == 1 and trainer.global_step == 2
    # By hand: one SGD step on window 2 (samples 24-47) alone.
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict({k.removeprefix("fc."): v for k, v in start.items()})
    loss = torch.nn.functional.cross_entropy(reference(inputs[24:]), labels[24:])
    loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    assert torch.allclose(net.fc.weight, reference.weight, atol=1e-6)
    assert torch.allclose(net.fc.bias, reference.bias, atol=1e-6)
    (record,) = trainer.logger.split("train")  # window 1 left no record
    assert record["step"] == 2
    with torch.no_grad():
        by_batch = [torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(inputs[i:i + 8], start["fc.weight"], start["fc.bias"]),
            labels[i:i + 8]) for i in (24, 32, 40)]
    assert record["loss"] == pytest.approx(float(sum(by_batch) / 3), abs=1e-6)


def test_4_one_train_record_per_interval_of_optimizer_steps(tmp_path):
    inputs, labels = blobs(64)
    trainer = make_trainer(tmp_path, epochs=2, grad_accum_steps=3, log_every_n_steps=2,
                           train_loader=loader(inputs, labels, batch_size=8))
    trainer.fit()  # 8 micro-batches: windows of 3, 3, 2 -> 3 steps an epoch
    steps = [r["step"] for r in trainer.logger.split("train")]
    assert steps == [2, 3, 4, 6]


def test_5_a_sample_is_the_same_whichever_worker_loads_it():
    seeded = SeededDataset(NoisyBlobs(24), seed=7)
    seeded.epoch.fill_(3)

    def load_all(workers: int) -> torch.Tensor:
        batches = torch.utils.data.DataLoader(seeded, batch_size=4, num_workers=workers,
                                              multiprocessing_context="fork")
        return torch.cat([x for x, _ in batches])

    two, one = load_all(2), load_all(1)  # batches alternate between 2 workers, or not
    assert torch.equal(two, one)
    seeded.epoch.fill_(4)
    assert not torch.equal(load_all(2), two)  # another epoch, other draws


@pytest.mark.parametrize("persistent", [False, True])
def test_5_epoch_boundary_resume_with_workers_equals_a_straight_run(tmp_path, persistent):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    for folder in (straight, cut):
        config(folder, "fp32", 1, "stop", 2, persistent)
    assert echelon3("train", straight) == 0
    assert echelon3("train", cut, "trainer.config.epochs=1") == 0
    assert echelon3("train", cut) == 0
    a, b = outcome(straight / "out"), outcome(cut / "out")
    for key in ("weights", "optimizer"):
        assert same_nested(a[key], b[key]), key


def test_6_parameters_without_a_gradient_stay_untouched_through_a_window(tmp_path,
                                                                         combo_env):
    config(tmp_path, "fp32", 3, "stop", 0, False)
    combo_env(signal_at=8)
    assert echelon3("train", tmp_path) == preemption.RESUBMIT_EXIT
    (mid,) = (tmp_path / "out").glob("checkpoint-1-step*.tar")
    grads = load(mid)["mid_epoch"]["ranks"][0]["stepping"]["grads"]
    assert sum(g is None for g in grads) == 2  # spare.weight, spare.bias
    preemption.reset()
    assert echelon3("train", tmp_path) == 0
    first = load(tmp_path / "out" / "checkpoint-1.tar")["model_state_dict"]
    last = load(tmp_path / "out" / "checkpoint-2.tar")["model_state_dict"]
    for name in ("spare.weight", "spare.bias"):
        assert torch.equal(first[name], last[name]), name


def test_7_profile_stop_after_keeps_the_last_interval(tmp_path):
    trainer = make_trainer(tmp_path, epochs=1, log_every_n_steps=2,
                           profile={"wait": 0, "warmup": 0, "active": 3, "stop_after": True,
                                    "dir": str(tmp_path / "profile")})
    trainer.fit()
    assert [r["step"] for r in trainer.logger.split("train")] == [2, 3]


def test_closure_optimizers_declare_themselves():
    class MySAM(SAMOptimizer):
        pass

    params = [torch.nn.Parameter(torch.zeros(2))]
    assert is_closure_optimizer(MySAM(params, torch.optim.SGD, lr=0.1))
    assert is_closure_optimizer(torch.optim.LBFGS(params))
    assert not is_closure_optimizer(torch.optim.SGD(params, lr=0.1))


def test_history_after_a_resume_in_history_jsonl_has_no_duplicate(tmp_path, combo_env):
    config(tmp_path, "fp32", 3, "stop", 0, False)
    combo_env(signal_at=8)
    assert echelon3("train", tmp_path) == preemption.RESUBMIT_EXIT
    preemption.reset()
    assert echelon3("train", tmp_path) == 0
    steps = [r["step"] for r in history(tmp_path / "out", "train")]
    assert steps == sorted(set(steps)) and steps[-1] == 4



def test_after_a_world_size_change_each_rank_draws_its_own_stream():
    from echelon3.data.rng import restore_for_rank, rng_state, set_rng_state

    torch.manual_seed(3)
    saved = rng_state()
    draws = {}
    for rank in (0, 1):
        restore_for_rank([saved], saved, rank, 2)  # written by 1 rank, resumed by 2
        draws[rank] = torch.rand(4)
    assert not torch.equal(draws[0], draws[1])
    restore_for_rank([saved], saved, 0, 1)  # the same world: exactly the saved state
    set_rng_state(saved)
    expected = torch.rand(4)
    restore_for_rank([saved], saved, 0, 1)
    assert torch.equal(torch.rand(4), expected)
