"""config/config.yaml: defaults, sweeps, and the checks made before anything is
planned (one line naming the key at fault)."""

from __future__ import annotations

import pytest
import yaml

from tests.workflow.helpers import (CHAIN, REPO, copy_workflow, failing, jobs_for, planned,
                                    resources_of, shell_commands, snakemake)


def test_default_config_plans_every_rule_for_the_digits_experiments(tmp_path):
    out = snakemake(copy_workflow(tmp_path), "-n")
    assert planned(out) == jobs_for("digits_cnn", "digits_mlp") | CHAIN


def test_schema_fills_in_defaults(tmp_path):
    wf = copy_workflow(tmp_path, {"experiments": {"bare": {"config": "digits_mlp"}}})
    out = snakemake(wf, "-n", "-p")
    res = resources_of(out, "train", "bare")
    assert (res["cpus_per_task"], res["mem_mb"], res["runtime"], res["nodes"]) == \
        ("2", "4000", "60", "1")
    assert "gpu" not in res and "mpi" not in res
    assert ("ECHELON3_EXPERIMENT=bare echelon3 train -cd config/experiments -cn digits_mlp "
            "on_config_change=restart device=cpu  target.path=results/bare"
            " > logs/train/bare.log 2>&1") in shell_commands(out)


FILE = "config/config.yaml: "


def shipped_with(change) -> dict:
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    change(config)
    return config


@pytest.mark.parametrize("bad, message", [
    ({"experiments": {"x": {"config": "digits_mlp", "resources": {"gpus": -1}}}},
     "experiments.x.resources.gpus: -1 is less than the minimum of 0"),
    ({"experiments": {"x": {"config": "digits_mlp", "resorces": {}}}},
     "experiments.x.resorces: unknown key (did you mean 'resources'?)"),
    ({"experiments": {"x": {"overrides": []}}}, "experiments.x: 'config' is a required property"),
    ({"experiments": {"x": {"config": "digits_mlp", "overrides": "lr=1"}}},
     "experiments.x.overrides: 'lr=1' is not of type 'array'"),
    ({"experiments": {"bad name": {"config": "digits_mlp"}}}, "'bad name' does not match"),
    ({"experiments": {}}, FILE + "experiments: none listed; list at least one under 'experiments:'"),
    ({"experiments": {"x": {"config": "digits_mlp", "resources": {"launcher": "srun"}}}},
     FILE + "experiments.x.resources.launcher: srun starts one task per GPU"),
    ({"sweeps": {"s": {"config": "digits_mlp", "grid": {"seed": [1]}, "resources":
                       {"launcher": "srun", "gpus": 0, "nodes": 1}}}},
     FILE + "sweeps.s.resources.launcher: srun starts one task per GPU (one per node on"),
    ({"experiments": {"x": {"config": "digits_mlp", "resources": {"launcher": "mpirun"}}}},
     "experiments.x.resources.launcher: 'mpirun' is not one of ['echelon3', 'srun']"),
    # a typo in a top-level key of the shipped file
    (shipped_with(lambda c: c.update(leaderbord=c.pop("leaderboard"))),
     FILE + "leaderbord: unknown key (did you mean 'leaderboard'?)"),
    # an experiment naming a config file that does not exist
    (shipped_with(lambda c: c["experiments"]["digits_mlp"].update(config="my_mpl")),
     FILE + "experiments.digits_mlp.config: no file config/experiments/my_mpl.yaml; "
            "configs in config/experiments: char_gpt, digits_cnn, "),
    # a sweep key that its config does not have
    ({"sweeps": {"s": {"config": "digits_mlp", "grid": {"optimizer.config.lrr": [0.1]}}}},
     FILE + "sweeps.s.grid.optimizer.config.lrr: digits_mlp has no key "
            "'optimizer.config.lrr' (did you mean 'optimizer.config.lr'?)"),
])
def test_bad_config_stops_with_one_line_naming_the_key(tmp_path, bad, message):
    wf = copy_workflow(tmp_path, bad)
    out = failing(wf, "-n").stdout
    line = next((line for line in out.splitlines() if message in line), None)
    assert line is not None, out
    assert "Failed validating" not in out and "On instance" not in out


def test_a_bad_config_is_caught_before_results_exist_too(tmp_path):
    """With results present, a misspelt config name used to plan only the report."""
    wf = copy_workflow(tmp_path, shipped_with(
        lambda c: c["experiments"]["digits_mlp"].update(config="my_mpl")))
    (wf / "results/digits_mlp").mkdir(parents=True)
    (wf / "results/digits_mlp/best.tar").write_bytes(b"")
    assert "experiments.digits_mlp.config: no file" in failing(wf, "-n").stdout


def test_a_sweep_may_add_its_grid_key_with_an_override(tmp_path):
    wf = copy_workflow(tmp_path, {"sweeps": {"s": {
        "config": "digits_mlp", "overrides": ["+net.config.extra=0"],
        "grid": {"net.config.extra": [1, 2]}}}})
    assert planned(snakemake(wf, "-n")) == jobs_for("s/extra~1", "s/extra~2")


def test_sweep_expands_a_grid_with_paramspace(tmp_path):
    wf = copy_workflow(tmp_path, {"sweeps": {"lr": {
        "config": "digits_mlp",
        "overrides": ["trainer.config.epochs=3"],
        "grid": {"optimizer.config.lr": [0.1, 0.01], "net.config.dropout": [0.0, 0.5]},
    }}})
    out = snakemake(wf, "-n", "-p")
    names = [f"lr/lr~{lr}_dropout~{d}" for lr in ("0.1", "0.01") for d in ("0.0", "0.5")]
    assert planned(out) == jobs_for(*names)
    assert ("echelon3 train -cd config/experiments -cn digits_mlp on_config_change=restart "
            "device=cpu trainer.config.epochs=3 optimizer.config.lr=0.01 net.config.dropout=0.5 "
            "target.path='results/lr/lr~0.01_dropout~0.5'") in out
    assert "results/plots/sweeps/lr.png" in out


def test_sweep_keys_must_end_in_distinct_names(tmp_path):
    wf = copy_workflow(tmp_path, {"sweeps": {"s": {
        "config": "digits_mlp",
        "grid": {"optimizer.config.lr": [0.1], "scheduler.config.gamma": [0.5],
                 "net.config.lr": [1]},
        "overrides": ["+net.config.lr=0"],
    }}})
    out = failing(wf, "-n").stdout
    assert FILE + "sweeps.s.grid: 'optimizer.config.lr' and 'net.config.lr' both end in 'lr'" \
        in out
    assert 'File "' not in out and "WorkflowError" not in out, out  # one line, no frames


def test_a_config_error_is_one_line_without_snakemake_frames(tmp_path):
    wf = copy_workflow(tmp_path, shipped_with(lambda c: c.update(leaderbord=c.pop("leaderboard"))))
    out = failing(wf, "-n").stdout
    told = [line for line in out.splitlines() if "leaderbord" in line]
    assert told == [FILE + "leaderbord: unknown key (did you mean 'leaderboard'?); known here: "
                    "config_dir, experiments, sweeps, leaderboard, one_job_per_experiment, "
                    "warm_start"], out
    assert 'File "' not in out and "WorkflowError" not in out, out
