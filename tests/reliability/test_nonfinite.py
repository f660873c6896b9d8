"""A NaN or infinite loss: stop at the first one, naming epoch, step and term, before anything
is saved from it on (default); or skip such steps and say how many (``nan_policy: skip``)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import echelon3, history, load, make_trainer, target, write_config

FAULTS = str(__import__("pathlib").Path(__file__).with_name("faults.py"))
PROMISE = "non-finite loss: stop at the first, or skip and count"


def _with_trap(folder, steps, value="nan", **trainer):
    trap = {"trap": {"module": FAULTS, "type": "NonFiniteAt", "weight": 1.0,
                     "config": {"steps": steps, "value": value}}}
    ce = {"ce": {"module": "torch.nn", "type": "CrossEntropyLoss", "weight": 1.0}}
    write_config(folder, {"loss": [ce, trap], "trainer": {"config": trainer}})


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("echelon3:")]


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_the_first_non_finite_loss_stops_the_run_before_anything_is_saved(tmp_path, capfd,
                                                                          ledger, value):
    # 6 steps per epoch, a record every 2: step 7 is seen at step 8's record, and
    # nothing from step 7 on may reach best.tar, a checkpoint or the history.
    _with_trap(tmp_path, [7, 11], value)
    out = target(tmp_path)
    assert echelon3("train", tmp_path) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert _error_lines(err) == [
        f"echelon3: error: non-finite loss at epoch 2, step 7: loss term 'trap' is {value}; "
        "stopped before saving anything from this step on (trainer.config.nan_policy: stop; "
        "'skip' leaves such steps out)"]
    assert load(out / "best.tar")["global_step"] == 6
    assert sorted(p.name for p in out.glob("checkpoint-*.tar")) == ["checkpoint-1.tar"]
    assert max(r["step"] for r in history(out)) == 6
    ledger(PROMISE, trials=1, faults=1)


def test_skip_leaves_out_the_bad_steps_and_says_how_many(tmp_path, capfd, ledger):
    _with_trap(tmp_path, [3, 7, 8], nan_policy="skip")
    out = target(tmp_path)
    assert echelon3("train", tmp_path) == 0
    err = capfd.readouterr().err
    assert "epoch 1: skipped 1 step(s) whose loss was not finite" in err
    assert "epoch 2: skipped 2 step(s) whose loss was not finite" in err
    assert "3 step(s) skipped for a non-finite loss in this run" in err
    state = load(out / "checkpoint-2.tar")
    assert state["global_step"] == 12
    assert all(torch.isfinite(w).all() for w in state["model_state_dict"].values())
    assert all(math.isfinite(r["loss"]) for r in history(out, "train"))
    ledger(PROMISE, trials=1, faults=3)


def test_gradscaler_overflow_steps_are_not_counted_as_non_finite(tmp_path, ledger):
    trainer = make_trainer(tmp_path, precision="fp16", epochs=2, nan_policy="skip")
    # A scale this large overflows the fp16 gradients: the scaler skips those steps itself
    # and halves the scale, while the loss stays finite.
    trainer.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 60)
    trainer.fit()
    assert trainer.precision.scaler.get_scale() < 2.0 ** 60
    assert trainer.nonfinite.skipped == 0
    ledger(PROMISE, trials=1)


def test_skip_with_a_closure_optimizer_is_refused_naming_the_key(tmp_path, capfd):
    write_config(tmp_path, {"optimizer": {"module": "echelon3.optimizers.sam",
                                          "type": "SAMOptimizer", "config": {"lr": 0.05}},
                            "trainer": {"config": {"nan_policy": "skip"}}})
    assert echelon3("train", tmp_path) == 2
    assert "trainer.config.nan_policy: 'skip' cannot undo" in capfd.readouterr().err


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1.0])
@pytest.mark.parametrize("weight", [0.0, 1.0, -2.5])
def test_the_log_points_loss_means_see_every_non_finite_term(bad, weight):
    """The guard's flag is the log point's mean losses: a non-finite term (even of weight
    0) makes its total and so the mean non-finite, so the flag says what a look at every
    term says; the error names the term."""
    from echelon3.data.batches import weighted_loss
    from echelon3.trainers.nonfinite import NonFiniteGuard, NonFiniteLoss
    from echelon3.trainers.running import RunningLosses

    pred, target = torch.zeros(2, 3), torch.tensor([0, 1])
    losses = {"ce": (torch.nn.CrossEntropyLoss(), 1.0),
              "odd": (lambda p, t: torch.tensor(bad), weight)}
    guard, running = NonFiniteGuard("stop"), RunningLosses(["loss", "ce", "odd"], False)
    for step in (1, 2):
        total, parts = weighted_loss(losses, pred, target)
        guard.observe(1, step, [{"loss": total.detach(), **parts}])
        running.add({"loss": total.detach(), **parts})
    every_term = not all(torch.isfinite(v).all() for _, _, p in guard.window for v in p.values())
    guard.close_interval()
    try:
        guard.read(running.take().tolist())
        raised = None
    except NonFiniteLoss as e:
        raised = str(e)
    assert (raised is not None) == every_term == (bad != 1.0)
    assert raised is None or "step 1: loss term 'odd'" in raised
    assert guard.unread == []


def test_finite_losses_whose_sum_overflowed_pass_and_are_forgotten():
    from echelon3.trainers.nonfinite import NonFiniteGuard

    guard = NonFiniteGuard("stop")
    guard.observe(1, 1, [{"loss": torch.tensor(3e38)}, {"loss": torch.tensor(3e38)}])
    guard.close_interval()
    guard.read([float("inf")])  # what the sum of the two reads: a look at each passes
    assert guard.unread == [] and guard.window == []
