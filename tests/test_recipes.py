"""Recipe features against independent computations: per-step schedules (the recorded
learning rate against the schedule's formula and torch's own scheduler stepped by hand),
gradient clipping (against ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` in a
hand-written loop, per precision, with accumulation), EMA (against a hand-written
average) and early stopping (a planted metric sequence). Resume of all of them mid-epoch
is in tests/test_combinations.py (the ``recipe`` factor); two ranks with clipping in
tests/test_accumulation.py.
"""

from __future__ import annotations

import copy
import json
import logging
import math

import pytest
import torch
from omegaconf import OmegaConf

from echelon3.config.errors import BuildError, ConfigError
from echelon3.trainers import schedulers
from echelon3.trainers.early_stopping import EarlyStopping
from tests.helpers import blobs, echelon3, history, load, make_trainer, write_config

LR = 0.1
STEPS, EPOCHS = 4, 3  # blobs(): 64 samples, batch 16


def warmup_cosine(warmup: int, t_max: str) -> dict:
    lr = "torch.optim.lr_scheduler"
    return {"scheduler": {"module": lr, "type": "SequentialLR", "interval": "step", "config": {
        "milestones": [warmup], "schedulers": [
            {"module": lr, "type": "LinearLR",
             "config": {"start_factor": 0.1, "total_iters": warmup}},
            {"module": lr, "type": "CosineAnnealingLR", "config": {"T_max": t_max}}]}}}


def scheduled_trainer(tmp_path, scheduler: dict, **settings):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    built = schedulers.build(OmegaConf.create(scheduler), optimizer, steps_per_epoch=STEPS,
                             epochs=EPOCHS)
    settings.setdefault("log_every_n_steps", 1)
    return make_trainer(tmp_path, net=net, optimizer=optimizer, scheduler=built,
                        scheduler_interval=schedulers.interval(OmegaConf.create(scheduler)),
                        epochs=EPOCHS, **settings)


def test_warmup_then_cosine_per_step_follows_the_formula(tmp_path):
    warmup, total = 3, STEPS * EPOCHS
    trainer = scheduled_trainer(tmp_path, warmup_cosine(warmup, "total_steps - 3"))
    trainer.fit()
    records = trainer.logger.split("train")
    assert [r["step"] for r in records] == list(range(1, total + 1))
    for record in records:
        k = record["step"] - 1  # steps done before this one
        expected = LR * (0.1 + 0.9 * k / warmup) if k < warmup else \
            LR * (1 + math.cos(math.pi * (k - warmup) / (total - warmup))) / 2
        assert record["lr"] == pytest.approx(expected, rel=1e-9), record


def test_one_cycle_over_total_steps_matches_torch_stepped_by_hand(tmp_path):
    spec = {"scheduler": {"module": "torch.optim.lr_scheduler", "type": "OneCycleLR",
                          "interval": "step",
                          "config": {"max_lr": 1.0, "total_steps": "total_steps"}}}
    trainer = scheduled_trainer(tmp_path, spec)
    trainer.fit()  # OneCycleLR raises when stepped past total_steps
    by_hand = torch.optim.lr_scheduler.OneCycleLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR), max_lr=1.0,
        total_steps=STEPS * EPOCHS)
    expected = []
    for _ in range(STEPS * EPOCHS):
        expected.append(by_hand.get_last_lr()[0])
        by_hand.optimizer.step()
        by_hand.step()
    assert [r["lr"] for r in trainer.logger.split("train")] == pytest.approx(expected)


def test_epoch_interval_is_the_default_and_lengths_are_checked():
    spec = {"scheduler": {"module": "torch.optim.lr_scheduler", "type": "StepLR",
                          "config": {"step_size": "epochs // 2"}}}
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    cfg = OmegaConf.create(spec)
    assert schedulers.interval(cfg) == "epoch"
    assert schedulers.build(cfg, optimizer, steps_per_epoch=5, epochs=6).step_size == 3
    with pytest.raises(ConfigError, match="scheduler.interval"):
        schedulers.interval(OmegaConf.create({"scheduler": {**spec["scheduler"],
                                                            "interval": "batch"}}))
    bad = {"scheduler": {**spec["scheduler"], "config": {"step_size": "epochs ** 2"}}}
    with pytest.raises(BuildError, match=r"scheduler.config.step_size: cannot read"):
        schedulers.build(OmegaConf.create(bad), optimizer)



def test_a_length_under_one_for_the_real_run_is_refused_with_its_numbers():
    """digits_recipe's cosine after one epoch of warm-up, in a run of one epoch: the
    pre-flight (placeholder lengths) cannot tell; the builder, with the real ones, does."""
    spec = {"scheduler": {"module": "torch.optim.lr_scheduler", "type": "SequentialLR",
                          "interval": "step", "config": {"milestones": ["steps_per_epoch"],
            "schedulers": [
                {"module": "torch.optim.lr_scheduler", "type": "LinearLR",
                 "config": {"start_factor": 0.01, "total_iters": "steps_per_epoch"}},
                {"module": "torch.optim.lr_scheduler", "type": "CosineAnnealingLR",
                 "config": {"T_max": "total_steps - steps_per_epoch"}}]}}}
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    assert schedulers.build(OmegaConf.create(spec), optimizer, steps_per_epoch=23,
                            epochs=2).optimizer is optimizer
    with pytest.raises(BuildError) as caught:
        schedulers.build(OmegaConf.create(spec), optimizer, steps_per_epoch=23, epochs=1)
    assert str(caught.value) == (
        "scheduler.config.schedulers[1].config.T_max: 'total_steps - steps_per_epoch' is 0 "
        "for this run (steps_per_epoch 23, epochs 1, total_steps 23); it must be at least 1")


def test_a_schedule_in_the_wrong_unit_is_said_once_with_both_numbers(caplog):
    """interval: step with T_max counted in epochs cycles the cosine many times a run."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    wrong = {"scheduler": {"module": "torch.optim.lr_scheduler", "type": "CosineAnnealingLR",
                           "interval": "step", "config": {"T_max": "epochs - 2"}}}
    with caplog.at_level(logging.WARNING, logger="echelon3.trainers.schedulers"):
        schedulers.build(OmegaConf.create(wrong), optimizer, steps_per_epoch=30, epochs=10)
    assert [r.getMessage() for r in caplog.records] == [
        "scheduler.config.T_max: the schedule lasts 8 steps but the run has 300 "
        "(scheduler.interval: step); is the length counted in epochs?"]
    caplog.clear()
    warmup_then_cosine = {"scheduler": {
        "module": "torch.optim.lr_scheduler", "type": "SequentialLR", "interval": "step",
        "config": {"milestones": ["steps_per_epoch"], "schedulers": [
            {"module": "torch.optim.lr_scheduler", "type": "LinearLR",
             "config": {"start_factor": 0.01, "total_iters": "steps_per_epoch"}},
            {"module": "torch.optim.lr_scheduler", "type": "CosineAnnealingLR",
             "config": {"T_max": "total_steps - steps_per_epoch"}}]}}}
    right = {"scheduler": {**wrong["scheduler"], "interval": "epoch"}}
    with caplog.at_level(logging.WARNING, logger="echelon3.trainers.schedulers"):
        schedulers.build(OmegaConf.create(warmup_then_cosine), optimizer, steps_per_epoch=30,
                         epochs=10)
        schedulers.build(OmegaConf.create(right), optimizer, steps_per_epoch=30, epochs=10)
    assert caplog.records == []

# --------------------------------------------------------------------------- clipping

def hand_written(net, batches, precision, accum, clip, algorithm, lr=LR):
    """SGD with accumulation, autocast, GradScaler and clipping, written out; the norms."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    norms = []
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(net(x), y) / accum
        (scaler.scale(loss) if scaler else loss).backward()
        if (i + 1) % accum:
            continue
        if scaler:
            scaler.unscale_(optimizer)
        if algorithm == "norm":
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
        else:
            norms.append(float(torch.nn.utils.get_total_norm(
                [p.grad for p in net.parameters()])))
            torch.nn.utils.clip_grad_value_(net.parameters(), clip)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    return norms


@pytest.mark.parametrize("precision,algorithm", [("fp32", "norm"), ("bf16", "norm"),
                                                 ("fp16", "norm"), ("fp32", "value")])
def test_clipping_equals_torch_on_the_same_gradients(tmp_path, precision, algorithm):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    manual = copy.deepcopy(net)
    trainer = make_trainer(tmp_path, net=net, precision=precision, epochs=1,
                           grad_accum_steps=2, gradient_clip_val=0.05,
                           gradient_clip_algorithm=algorithm, log_every_n_steps=1)
    trainer.fit()
    inputs, labels = blobs()
    batches = [(inputs[i:i + 16], labels[i:i + 16]) for i in range(0, 64, 16)]
    norms = hand_written(manual, batches, precision, 2, 0.05, algorithm)
    assert min(norms) > 0.05  # clipping acted on every step
    recorded = [r["grad_norm"] for r in trainer.logger.split("train")]
    assert recorded == pytest.approx(norms, rel=1e-5)
    for a, b in zip(net.parameters(), manual.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_clipping_is_refused_for_a_closure_optimizer_and_checked(tmp_path):
    from echelon3.optimizers.sam import SAMOptimizer

    with pytest.raises(ConfigError, match="gradient_clip_val: a closure optimizer"):
        make_trainer(tmp_path, optimizer=lambda p: SAMOptimizer(p, torch.optim.SGD, lr=0.1),
                     gradient_clip_val=1.0)
    with pytest.raises(ConfigError, match="gradient_clip_algorithm: must be norm or value"):
        make_trainer(tmp_path, gradient_clip_val=1.0, gradient_clip_algorithm="max")


# --------------------------------------------------------------------------- EMA

def test_ema_equals_a_hand_written_average_and_is_what_best_tar_holds(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                              torch.nn.ReLU(), torch.nn.Linear(8, 3))
    manual = copy.deepcopy(net)
    decay, every, warmup = 0.8, 2, 4  # steps 2 and 4 copy, 6 and 8 average
    trainer = make_trainer(tmp_path, net=net, epochs=2, log_every_n_steps=1,
                           ema={"decay": decay, "every_n_steps": every, "warmup_steps": warmup})
    trainer.fit()
    inputs, labels = blobs()
    optimizer = torch.optim.SGD(manual.parameters(), lr=0.1)
    average = {k: v.clone() for k, v in manual.state_dict().items()}
    step = 0
    for _ in range(2):
        for i in range(0, 64, 16):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(manual(inputs[i:i + 16]),
                                              labels[i:i + 16]).backward()
            optimizer.step()
            step += 1
            if step % every:
                continue
            for k, v in manual.state_dict().items():
                if step <= warmup or not v.is_floating_point():
                    average[k] = v.clone()
                else:
                    average[k] = decay * average[k] + (1 - decay) * v
    saved = trainer.state_dict()
    for k, v in average.items():
        assert torch.allclose(saved["model_state_dict"][k].float(), v.float(), atol=1e-6), k
        assert torch.equal(saved["training_model_state_dict"][k], manual.state_dict()[k]), k
    # Validation scored the average: its loss is the average's loss on the test set.
    averaged = copy.deepcopy(manual)
    averaged.load_state_dict(average)
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(averaged.eval()(inputs), labels)
    assert trainer.logger.split("val")[-1]["loss"] == pytest.approx(float(loss), rel=1e-5)
    # Checkpoints and best.tar hold the average as the weights evaluate and export load.
    last = load(tmp_path / "ckpt" / "checkpoint-2.tar")
    assert torch.equal(last["model_state_dict"]["0.weight"], saved["model_state_dict"]["0.weight"])
    best = load(tmp_path / "ckpt" / "best.tar")
    chosen = load(tmp_path / "ckpt" / f"checkpoint-{best['epoch']}.tar")
    assert torch.equal(best["model_state_dict"]["0.weight"], chosen["model_state_dict"]["0.weight"])


# --------------------------------------------------------------------------- early stopping

@pytest.mark.parametrize("values,high,delta,patience,stops_at", [
    ([0.5, 0.6, 0.6, 0.65, 0.7], True, 0.1, 2, 3),     # +0.1 is not more than min_delta
    ([0.5, 0.7, 0.69, 0.68, 0.9], True, 0.0, 3, None),  # 3 epochs without: would stop at 5
    ([0.5, 0.7, 0.69, 0.68, 0.9], True, 0.0, 2, 4),
    ([1.0, 0.8, 0.81, 0.7, 0.75, 0.72], False, 0.05, 2, 6),
])
def test_early_stopping_stops_at_the_right_epoch(values, high, delta, patience, stops_at):
    early = EarlyStopping({"patience": patience, "min_delta": delta}, "m", high)
    stopped = next((epoch for epoch, v in enumerate(values, 1)
                    if early.update(epoch, {"m": v})), None)
    assert stopped == stops_at


class Planted:
    """A metric whose value at the n-th validation is ``VALUES[n]``."""
    VALUES = [0.3, 0.5, 0.55, 0.52, 0.9, 0.95]

    def __init__(self):
        self.calls = 0

    def update(self, preds, target):
        pass

    def compute(self):
        value = torch.tensor(self.VALUES[self.calls])
        self.calls += 1
        return value

    def reset(self):
        pass

    def to(self, device):
        return self


def test_an_early_stopped_run_is_finished_and_trains_no_more(tmp_path):
    """Planted accuracy 0.3, 0.5, 0.55, 0.52, ... with patience 2 and min_delta 0.1: epoch 2
    improves, 3 and 4 do not, the run stops after epoch 4 of 6; a rerun trains nothing."""
    write_config(tmp_path, {
        "metrics": [{"accuracy": {"module": "tests.test_recipes", "type": "Planted"}}],
        "trainer": {"config": {"epochs": 6, "early_stopping": {"patience": 2,
                                                                 "min_delta": 0.1}}}})
    assert echelon3("train", tmp_path) == 0
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs"] == 4
    assert summary["stopped_early"].startswith("stopped early after epoch 4: accuracy did "
                                               "not improve by more than 0.1 for 2 epoch(s)")
    assert [r["epoch"] for r in history(out, "val")] == [1, 2, 3, 4]
    assert load(out / "checkpoint-4.tar")["early_stopping"]["stopped_epoch"] == 4
    assert echelon3("train", tmp_path) == 0
    assert [r["epoch"] for r in history(out, "val")] == [1, 2, 3, 4]
    assert json.loads((out / "summary.json").read_text())["stopped_early"]
