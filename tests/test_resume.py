"""Resume or start: more epochs on a rerun, bit-identical continuation, best-so-far
kept, the history rewound, and what a changed config does."""

from __future__ import annotations

import logging

import pytest

from tests.helpers import (assert_same_tensors, echelon3, history, load, make_trainer, same_nested,
                           target, write_config)

STEPS = 6  # per epoch


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_rerun_with_more_epochs_trains_only_the_missing_ones(tmp_path, caplog):
    write_config(tmp_path)
    out = target(tmp_path)
    assert echelon3("train", tmp_path) == 0
    caplog.set_level(logging.INFO)
    caplog.clear()
    assert echelon3("train", tmp_path, "trainer.config.epochs=3") == 0
    assert any("Resuming from" in m and "checkpoint-2.tar" in m for m in _messages(caplog))
    summaries = [m for m in _messages(caplog) if m.startswith("epoch ")]
    assert [m.split(" step")[0] for m in summaries] == ["epoch 3"]
    val = history(out, "val")
    assert [(r["epoch"], r["step"]) for r in val] == [(1, STEPS), (2, 2 * STEPS), (3, 3 * STEPS)]
    steps = [r["step"] for r in history(out, "train")]
    assert steps == sorted(set(steps)) and steps[-1] == 3 * STEPS
    state = load(out / "checkpoint-3.tar")
    assert (state["epoch"], state["global_step"]) == (3, 3 * STEPS)
    assert sorted(p.name for p in out.glob("checkpoint-*.tar")) == ["checkpoint-2.tar",
                                                                    "checkpoint-3.tar"]
    # Once every epoch is done a rerun trains nothing and rewrites nothing.
    before = (out / "checkpoint-3.tar").read_bytes(), (out / "history.jsonl").read_text()
    caplog.clear()
    assert echelon3("train", tmp_path, "trainer.config.epochs=3") == 0
    assert before == ((out / "checkpoint-3.tar").read_bytes(), (out / "history.jsonl").read_text())
    assert not [m for m in _messages(caplog) if m.startswith("epoch ")]
    assert any("nothing to train" in m for m in _messages(caplog))


def test_the_best_so_far_survives_a_resume(tmp_path):
    # Loss falls while training, so "high" makes the first validation the best for good;
    # a resumed run that forgot it would take its first validation as a new best.
    write_config(tmp_path, {"trainer": {"config": {
        "keep_best_on": {"loss": {"mode": "directional", "value": "high"}}}}})
    out = target(tmp_path)
    assert echelon3("train", tmp_path) == 0
    best = (out / "best.tar").read_bytes()
    assert load(out / "best.tar")["global_step"] == STEPS
    assert echelon3("train", tmp_path, "trainer.config.epochs=4") == 0
    val = history(out, "val")
    assert len(val) == 4 and all(r["loss"] < val[0]["loss"] for r in val[1:])
    assert (out / "best.tar").read_bytes() == best


def test_a_run_killed_mid_epoch_resumes_with_a_clean_history(tmp_path):
    write_config(tmp_path / "straight")
    assert echelon3("train", tmp_path / "straight") == 0
    write_config(tmp_path / "killed")
    out = target(tmp_path / "killed")
    assert echelon3("train", tmp_path / "killed") == 0
    # As if killed in epoch 2 before its checkpoint: the history went further than
    # the newest checkpoint, with a line torn by the kill.
    (out / "checkpoint-2.tar").unlink()
    with open(out / "history.jsonl", "a") as f:
        f.write('{"split": "train", "epoch": 2, "st')
    assert echelon3("train", tmp_path / "killed") == 0
    assert history(out) == history(target(tmp_path / "straight"))


OPTIMIZERS = {
    "sgd": {"module": "torch.optim", "type": "SGD",
            "config": {"lr": 0.05, "momentum": 0.9, "nesterov": True}},
    "sam": {"module": "echelon3.optimizers.sam", "type": "SAMOptimizer",
            "config": {"rho": 0.05, "base_optimizer": {
                "module": "torch.optim", "type": "AdamW", "config": {"lr": 0.003}}}},
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_four_epochs_straight_equal_two_then_two_more(tmp_path, optimizer):
    """fp32 on the CPU, same seed: every weight and every piece of state is identical."""
    updates = {
        "net": {"config": {"dropout": 0.3}},  # the torch RNG matters from step to step
        "optimizer": OPTIMIZERS[optimizer],
        "trainer": {"config": {"epochs": 4, "times_to_validate_per_epoch": 2,
                               "precision": "fp32"}},
    }
    write_config(tmp_path / "straight", updates, remove=("optimizer",))
    write_config(tmp_path / "resumed", updates, remove=("optimizer",))
    assert echelon3("train", tmp_path / "straight") == 0
    assert echelon3("train", tmp_path / "resumed", "trainer.config.epochs=2") == 0
    assert echelon3("train", tmp_path / "resumed") == 0

    straight, resumed = target(tmp_path / "straight"), target(tmp_path / "resumed")
    a, b = load(straight / "checkpoint-4.tar"), load(resumed / "checkpoint-4.tar")
    assert_same_tensors(a["model_state_dict"], b["model_state_dict"])
    for key in ("optimizer_state_dict", "scheduler_state_dict", "scaler_state_dict", "epoch",
                "global_step", "metrics", "best_metrics", "rng_state"):
        assert same_nested(a[key], b[key]), key
    assert_same_tensors(load(straight / "best.tar")["model_state_dict"],
                        load(resumed / "best.tar")["model_state_dict"])
    assert history(straight) == history(resumed)
    # The comparison is not vacuous: training moved the weights between epochs 2 and 4.
    two = load(resumed / "checkpoint-3.tar")["model_state_dict"]
    assert any(not v.equal(two[k]) for k, v in b["model_state_dict"].items())


def test_a_resumed_trainer_takes_scaler_epoch_step_and_best_from_the_state(tmp_path):
    first = make_trainer(tmp_path / "a", epochs=1, precision="fp16")  # a GradScaler on the CPU
    first.fit()
    state = first.state_dict()
    assert state["scaler_state_dict"]["_growth_tracker"] == first.global_step > 0
    second = make_trainer(tmp_path / "b", epochs=2, precision="fp16", resume_state=state)
    assert second.precision.state_dict() == state["scaler_state_dict"]
    assert (second.epoch, second.global_step) == (1, first.global_step)
    assert second.best_metrics == first.best_metrics
    second.fit()
    assert second.epoch == 2 and second.global_step == 2 * first.global_step
    assert [r["epoch"] for r in second.logger.split("val")] == [2]


# --------------------------------------------------------------------------- a changed config


def test_a_changed_config_stops_with_exit_2_by_default(tmp_path, capsys):
    write_config(tmp_path)
    out = target(tmp_path)
    assert echelon3("train", tmp_path) == 0
    before = (out / "checkpoint-2.tar").read_bytes()
    assert echelon3("train", tmp_path, "optimizer.config.lr=0.01",
                    "trainer.config.epochs=3") == 2
    assert "on_config_change" in capsys.readouterr().err
    assert (out / "checkpoint-2.tar").read_bytes() == before
    assert not (out / "checkpoint-3.tar").exists()
    assert echelon3("train", tmp_path, "optimizer.config.lr=0.01", "trainer.config.epochs=3",
                    "on_config_change=error") == 2
    capsys.readouterr()
    assert echelon3("train", tmp_path, "optimizer.config.lr=0.01", "nproc=2") == 2
    err = capsys.readouterr().err  # the launcher refuses before any worker starts
    assert "starting 2 workers" not in err and err.count("echelon3: error:") == 1, err
    assert "optimizer.config.lr: 0.05 -> 0.01" in err.strip().splitlines()[-1], err


def test_a_changed_config_with_restart_moves_the_old_run_aside(tmp_path):
    write_config(tmp_path)
    out = target(tmp_path)
    assert echelon3("train", tmp_path) == 0
    old_best = (out / "best.tar").read_bytes()
    assert echelon3("train", tmp_path, "optimizer.config.lr=0.01",
                    "on_config_change=restart") == 0
    (aside,) = out.glob("superseded-*")
    assert {"checkpoint-1.tar", "checkpoint-2.tar", "best.tar", "history.jsonl"} <= {
        p.name for p in aside.iterdir()}
    assert (aside / "best.tar").read_bytes() == old_best
    val = history(out, "val")
    assert [r["epoch"] for r in val] == [1, 2]  # started over
    assert load(out / "checkpoint-2.tar")["optimizer_state_dict"]["param_groups"][0][
        "initial_lr"] == 0.01


def test_a_changed_config_with_resume_continues(tmp_path):
    write_config(tmp_path)
    out = target(tmp_path)
    assert echelon3("train", tmp_path) == 0
    assert echelon3("train", tmp_path, "optimizer.config.lr=0.01", "trainer.config.epochs=3",
                    "on_config_change=resume") == 0
    assert [r["epoch"] for r in history(out, "val")] == [1, 2, 3]
    assert not list(out.glob("superseded-*"))


def test_resuming_into_a_network_of_another_shape_is_a_clear_error(probe):
    from tests.conftest import run_cli

    config_dir, write = probe
    write(epochs=1)
    assert run_cli(["train", "-cd", str(config_dir), "-cn", "probe"]).returncode == 0
    result = run_cli(["train", "-cd", str(config_dir), "-cn", "probe", "trainer.config.epochs=2",
                      "net.config.classes=3", "on_config_change=resume"])
    assert result.returncode == 2
    assert "checkpoint-1.tar: does not fit the configured network" in result.stderr
    assert "size mismatch for fc.weight" in result.stderr and "Traceback" not in result.stderr
