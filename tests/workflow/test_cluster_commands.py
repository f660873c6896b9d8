"""Command lines and resources for GPUs, nodes and SLURM: dry runs under
profiles/slurm, the sbatch options the plugin submits (a fake sbatch), and the
srun + torchrun line of a two-node job run for real on this machine."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from tests.workflow.helpers import (CHAIN, RUN_S, SLURM_TOOLS, copy_workflow, env_with, experiment,
                                    jobs_for, planned, resources_of, shell_commands, snakemake)

PLACEHOLDERS = ("profiles/slurm: default-resources still hold the placeholders "
                "slurm_account 'my_account' and slurm_partition 'gpu'")

GPU_CONFIG = {"experiments": {
    "cpu": experiment("digits_mlp", cpus=2, mem_mb=4000, runtime=30),
    "one_node": experiment("digits_mlp", "~scheduler", cpus=8, gpus=2, mem_mb=16000,
                           runtime="2h"),
    "two_nodes": experiment("digits_cnn", gpus=4, nodes=2, cpus=32, mem_mb=64000,
                            runtime=600),
    "tasks": experiment("digits_mlp", cpus=8, gpus=2, launcher="srun"),
}}

TWO_NODE_SRUN = "srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --gres=gpu:4 --cpus-per-task=32"
TWO_NODE_TRAIN = (
    "ECHELON3_EXPERIMENT=two_nodes PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    f" {TWO_NODE_SRUN} torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d"
    " --rdzv_endpoint $(hostname):$((29500 + SLURM_JOB_ID % 20000)) --rdzv_id $SLURM_JOB_ID"
    " --no-python echelon3 train -cd config/experiments -cn digits_cnn on_config_change=restart"
    "   target.path=results/two_nodes > logs/train/two_nodes.log 2>&1"
)
TASKS_SRUN = "srun --ntasks=2 --gpus-per-task=1 --cpus-per-task=4"
TASKS_TRAIN = (
    f"ECHELON3_EXPERIMENT=tasks {TASKS_SRUN} echelon3 train -cd config/experiments -cn digits_mlp on_config_change=restart"
    "   target.path=results/tasks > logs/train/tasks.log 2>&1"
)
ONE_NODE_TRAIN = (
    "ECHELON3_EXPERIMENT=one_node workflow/scripts/gpu_lock.py 2 -- echelon3 train -cd config/experiments -cn digits_mlp"
    " on_config_change=restart 'gpus=[0,1]' '~scheduler' target.path=results/one_node"
    " > logs/train/one_node.log 2>&1"
)


def test_slurm_profile_dry_run_shows_resources_and_commands(tmp_path):
    wf = copy_workflow(tmp_path)
    out = snakemake(wf, "-n", "-p", "--profile", "profiles/slurm")
    assert planned(out) == jobs_for("digits_cnn", "digits_mlp") | CHAIN
    assert PLACEHOLDERS in out
    for rule in ("train", "evaluate", "run"):
        res = resources_of(out, rule, "digits_cnn")
        assert {k: res[k] for k in ("slurm_partition", "slurm_account", "cpus_per_task",
                                    "mem_mb", "runtime", "nodes")} == {
            "slurm_partition": "gpu", "slurm_account": "my_account", "cpus_per_task": "2",
            "mem_mb": "4000", "runtime": "30", "nodes": "1"}
    # the experiment's name comes first: MLflow's run name and tags (echelon3.observe.mlflow)
    assert ("ECHELON3_EXPERIMENT=digits_cnn echelon3 train -cd config/experiments -cn digits_cnn"
            " on_config_change=restart"
            " device=cpu  target.path=results/digits_cnn > logs/train/digits_cnn.log 2>&1"
            ) in shell_commands(out)
    assert ("ECHELON3_EXPERIMENT=digits_cnn echelon3 evaluate -cd config/experiments"
            " -cn digits_cnn device=cpu"
            "  target.path=results/digits_cnn"
            " evaluator.config.output=results/digits_cnn/metrics.json"
            " > logs/evaluate/digits_cnn.log 2>&1") in shell_commands(out)


def test_two_node_and_multi_gpu_dry_run(tmp_path):
    wf = copy_workflow(tmp_path, GPU_CONFIG)
    out = snakemake(wf, "-n", "-p", "--profile", "profiles/slurm")
    commands = shell_commands(out)
    assert TWO_NODE_TRAIN in commands
    assert ONE_NODE_TRAIN in commands
    two = resources_of(out, "train", "two_nodes")
    assert {k: two.get(k) for k in ("nodes", "gres", "tasks", "tasks_per_gpu", "mpi",
                                     "cpus_per_task", "mem_mb", "runtime", "gpu")} == {
        "nodes": "2", "gres": "gpu:4", "tasks": "2", "tasks_per_gpu": "0",
        "mpi": TWO_NODE_SRUN, "cpus_per_task": "32", "mem_mb": "64000", "runtime": "600",
        "gpu": None}
    one = resources_of(out, "train", "one_node")
    assert (one["gpu"], one["nodes"], one["runtime"], one["tasks_per_gpu"], one.get("mpi")) == \
        ("2", "1", "120", "0", None)
    # evaluate and run use one GPU on one node
    for rule in ("evaluate", "run"):
        res = resources_of(out, rule, "two_nodes")
        assert (res["gpu"], res["nodes"], res["tasks_per_gpu"], res.get("mpi")) == \
            ("1", "1", "0", None)
    assert "tasks_per_gpu" not in resources_of(out, "train", "cpu")
    # launcher: srun: one echelon3 per GPU, each a task of srun
    assert TASKS_TRAIN in commands
    tasks = resources_of(out, "train", "tasks")
    assert {k: tasks.get(k) for k in ("nodes", "gpu", "tasks", "tasks_per_gpu", "mpi",
                                       "cpus_per_task", "gres")} == {
        "nodes": "1", "gpu": "2", "tasks": "2", "tasks_per_gpu": "1", "mpi": TASKS_SRUN,
        "cpus_per_task": "4", "gres": None}
    assert ("ECHELON3_EXPERIMENT=two_nodes workflow/scripts/gpu_lock.py 1 -- echelon3 run -cd config/experiments"
            " -cn digits_cnn 'gpus=[0]'  target.path=results/two_nodes"
            " runner.config.output=results/two_nodes/predictions.csv"
            " > logs/run/two_nodes.log 2>&1") in commands


def fake_slurm(folder: Path) -> Path:
    """sbatch that records its command line and refuses the job; the other
    SLURM tools answer nothing, so that nothing reaches a real cluster."""
    folder.mkdir()
    (folder / "sbatch").write_text(
        '#!/bin/sh\nprintf "%s\\n" "$*" >> "$SBATCH_CALLS"\necho "sbatch: error: refused" >&2\n'
        "exit 1\n")
    for tool in SLURM_TOOLS:
        (folder / tool).write_text("#!/bin/sh\nexit 0\n")
    for tool in folder.iterdir():
        tool.chmod(0o755)
    return folder


# the profile's early warning before the wall time, for train jobs (preemption)
SIGNAL = "--signal=USR1@120"


def sbatch_calls(wf: Path, tmp_path: Path, *args: str) -> list[str]:
    """The sbatch command lines (options only) of a run of the whole workflow
    under profiles/slurm, whose sbatch refuses every job."""
    fakes = fake_slurm(tmp_path / "bin")
    calls = tmp_path / "sbatch.calls"
    env = env_with(SBATCH_CALLS=str(calls))
    env["PATH"] = f"{fakes}{os.pathsep}{env['PATH']}"
    out = snakemake(wf, "--profile", "profiles/slurm", "--retries", "0", "--jobs", "4",
                    "--slurm-init-seconds-before-status-checks", "1", *args, env=env,
                    check=False, timeout=RUN_S)
    assert calls.is_file() and "At least one job did not complete" in out, out[-3000:]
    return [c.split(" --wrap=")[0] for c in calls.read_text().splitlines()]


def test_slurm_plugin_submits_the_expected_sbatch_options(tmp_path):
    """One job per experiment (train, evaluate and run of it: one Snakemake group),
    with exactly train's options: evaluate and run add nothing to them."""
    wf = copy_workflow(tmp_path / "wf", GPU_CONFIG)
    calls = sbatch_calls(wf, tmp_path)
    submitted = {re.search(r"--comment rule_exp_(\S+)_evaluate_run_train ", c).group(1): c
                 for c in calls}
    assert len(calls) == len(submitted), calls
    assert set(submitted) == {"cpu", "one_node", "two_nodes", "tasks"}
    for options in submitted.values():
        assert " -p gpu " in options and " -A my_account " in options
    assert submitted["cpu"].endswith(
        "-t 30 --mem 4000 --nodes=1 --ntasks=1 --cpus-per-task=2 " + SIGNAL + " -D "
        + str(wf))
    assert submitted["one_node"].endswith(
        "-t 120 --mem 16000 --nodes=1 --cpus-per-task=8 " + SIGNAL + " -D " + str(wf)
        + " --gpus=2")
    assert submitted["two_nodes"].endswith(
        "-t 600 --mem 64000 --nodes=2 --ntasks=2 --cpus-per-task=32 " + SIGNAL + " -D " + str(wf)
        + " --gres=gpu:4")
    assert "--ntasks-per-gpu" not in submitted["two_nodes"] + submitted["one_node"]
    assert submitted["tasks"].endswith(
        "-t 60 --mem 4000 --nodes=1 --ntasks-per-gpu=1 --ntasks=2 --cpus-per-task=4 "
        + SIGNAL + " -D "
        + str(wf) + " --gpus=2")


def test_trained_experiments_and_the_switch_submit_a_job_per_rule(tmp_path):
    """An experiment trained before the workflow started submits evaluate and run
    as jobs of their own, each with its own options; one_job_per_experiment: false
    does so for every experiment."""
    wf = copy_workflow(tmp_path / "wf", {"experiments": {
        "cpu": GPU_CONFIG["experiments"]["cpu"], "tasks": GPU_CONFIG["experiments"]["tasks"]}})
    (wf / "results/cpu").mkdir(parents=True)
    for name in ("best.tar", "summary.json"):
        (wf / "results/cpu" / name).write_text("{}")
    calls = sbatch_calls(wf, tmp_path)
    own = "-t 30 --mem 4000 --nodes=1 --ntasks=1 --cpus-per-task=2 -D " + str(wf)
    comments = {re.search(r"--comment (\S+)", c).group(1): c for c in calls}
    assert set(comments) == {"rule_evaluate_wildcards_cpu", "rule_run_wildcards_cpu",
                             "rule_exp_tasks_evaluate_run_train"}, calls
    assert comments["rule_evaluate_wildcards_cpu"].endswith(own)
    assert comments["rule_run_wildcards_cpu"].endswith(own)

    shutil.rmtree(wf / "results")
    (tmp_path / "off").mkdir()
    off = sbatch_calls(wf, tmp_path / "off", "--config", "one_job_per_experiment=False")
    comments = {re.search(r"--comment (\S+)", c).group(1): c for c in off}
    assert set(comments) == {"rule_train_wildcards_cpu", "rule_train_wildcards_tasks"}, off
    assert comments["rule_train_wildcards_cpu"].endswith(
        "-t 30 --mem 4000 --nodes=1 --ntasks=1 --cpus-per-task=2 " + SIGNAL + " -D " + str(wf))


def test_a_second_profile_adds_site_settings(tmp_path):
    wf = copy_workflow(tmp_path)
    site = wf / "site"
    site.mkdir()
    (site / "config.yaml").write_text(
        "default-resources:\n  slurm_partition: main\n  mem_mb: 1000\nslurm-no-account: true\n")
    out = snakemake(wf, "-n", "--profile", "profiles/slurm", "--profile", "site")
    res = resources_of(out, "train", "digits_mlp")
    assert res["slurm_partition"] == "main" and "slurm_account" not in res
    assert "placeholders" not in out
    assert res["mem_mb"] == "4000"  # the experiment's own, not the default


def test_two_node_command_line_runs(tmp_path):
    """The srun + torchrun line of a 2-node job, with an srun that starts its
    tasks on this machine: two torchrun agents meet at the endpoint and train
    one run with two ranks (gloo, CPU)."""
    wf = copy_workflow(tmp_path / "wf", {"experiments": {
        "two_nodes": experiment("digits_mlp", "trainer.config.epochs=1", nodes=2)}})
    fakes = tmp_path / "bin"
    fakes.mkdir()
    (fakes / "srun").write_text(
        "#!/usr/bin/env bash\n"
        "n=1\n"
        "while [[ $1 == -* ]]; do [[ $1 == --ntasks=* ]] && n=${1#--ntasks=}; shift; done\n"
        "for ((i = 0; i < n; i++)); do SLURM_PROCID=$i SLURM_NTASKS=$n \"$@\" & done\n"
        "rc=0; for job in $(jobs -p); do wait $job || rc=$?; done; exit $rc\n")
    (fakes / "srun").chmod(0o755)
    env = env_with(SLURM_JOB_ID=str(4000 + os.getpid() % 1000))
    env["PATH"] = f"{fakes}{os.pathsep}{env['PATH']}"
    snakemake(wf, "-j1", "results/two_nodes/best.tar", env=env, timeout=RUN_S)
    log = (wf / "logs/train/two_nodes.log").read_text()
    assert "training on cpu x2" in log, log
    assert (wf / "results/two_nodes/best.tar").is_file()
