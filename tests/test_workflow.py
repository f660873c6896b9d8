"""The Snakemake workflow: Snakefile, workflow/, config/config.yaml, profiles/.

Every test works on a copy of the workflow in tmp_path (Snakefile, workflow/,
config/, profiles/) and runs the real `snakemake` and `echelon3` commands.
Dry runs check planning, resources and command lines; a few small real runs
check outputs, replanning, retraining and resume after a kill.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GPU_LOCK = REPO / "workflow" / "scripts" / "gpu_lock.py"
SLURM_TOOLS = ("sinfo", "squeue", "sacct", "sacctmgr", "sshare", "scontrol", "scancel")

DRY_S = 120  # one dry run, generous for a loaded 2-core machine
RUN_S = 600  # one real run


# --- helpers ----------------------------------------------------------------------


def copy_workflow(dest: Path, config: dict | None = None) -> Path:
    """The workflow in `dest`; `config` replaces config/config.yaml when given."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "Snakefile", dest / "Snakefile")
    for folder in ("workflow", "config", "profiles"):
        shutil.copytree(REPO / folder, dest / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    if config is not None:
        (dest / "config" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return dest


def env_with(**extra) -> dict:
    """This environment without launcher variables (a test run inside a SLURM
    job or torchrun must not look distributed), plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def snakemake(cwd: Path, *args: str, timeout: float = DRY_S, env: dict | None = None,
              check: bool = True) -> str:
    """Run snakemake in `cwd`; its stdout and stderr together."""
    proc = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd,
                          env=env or env_with(), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout)
    if check and proc.returncode != 0:
        logs = "".join(f"\n--- {p}\n{p.read_text()[-3000:]}" for p in sorted(cwd.glob("logs/**/*.log")))
        raise AssertionError(f"snakemake {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-6000:]}{logs}")
    return proc.stdout


JOB = re.compile(r"^(?:local)?rule (\w+):\n((?:[ \t]+.*\n)*)", re.M)


def planned(output: str) -> set[tuple[str, str | None]]:
    """(rule, experiment) of every job a dry run lists."""
    jobs = set()
    for rule, body in JOB.findall(output):
        found = re.search(r"wildcards: exp=([^,\s]+)", body)
        jobs.add((rule, found.group(1) if found else None))
    return jobs


def jobs_for(*experiments: str) -> set[tuple[str, str | None]]:
    per_exp = {(rule, exp) for exp in experiments for rule in ("train", "evaluate", "run")}
    return per_exp | {("report", None), ("all", None)}


# The embedded default's chain: digits_mlp_ft finetunes digits_mlp's best.tar, then exports.
CHAIN = {("finetune", "digits_mlp_ft"), ("evaluate", "digits_mlp_ft"), ("run", "digits_mlp_ft"),
         ("export", "digits_mlp_ft")}


def shell_commands(output: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in output.splitlines()
            if line.startswith("Shell command:")]


def resources_of(output: str, rule: str, exp: str) -> dict[str, str]:
    for name, body in JOB.findall(output):
        if name == rule and f"wildcards: exp={exp}\n" in body:
            line = re.search(r"resources: (.*)", body).group(1)
            return dict(item.split("=", 1) for item in re.split(r", (?=\w+=)", line))
    raise AssertionError(f"no {rule} job for {exp} in:\n{output[-3000:]}")


def descendants(pid: int) -> list[int]:
    """Processes below `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"snakemake ended (rc {proc.returncode}) before {what}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def checkpoint_epochs(folder: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in folder.glob("checkpoint-*.tar")
                  if (m := re.fullmatch(r"checkpoint-(\d+)\.tar", p.name)))


def resumed_epoch(log: Path) -> int:
    found = re.search(r"Resuming from \S*checkpoint-(\d+)\.tar", log.read_text())
    assert found, f"{log} does not resume:\n{log.read_text()[-3000:]}"
    return int(found.group(1))


def experiment(config: str, *overrides: str, **resources) -> dict:
    return {"config": config, "overrides": list(overrides), "resources": {"cpus": 1, **resources}}


# --- style -------------------------------------------------------------------------


def test_snakemake_lint_is_clean(tmp_path):
    out = snakemake(copy_workflow(tmp_path), "--lint")
    assert "Lints for" not in out, out
    assert "Congratulations" in out


def test_rules_are_snakefmt_formatted():
    files = [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]
    proc = subprocess.run([sys.executable, "-m", "snakefmt", "--check", *map(str, files)],
                          text=True, capture_output=True, timeout=DRY_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- config and schema -------------------------------------------------------------


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
    assert ("echelon3 train -cd config/experiments -cn digits_mlp on_config_change=restart "
            "device=cpu  target.path=results/bare > logs/train/bare.log 2>&1") in shell_commands(out)


@pytest.mark.parametrize("bad, message", [
    ({"experiments": {"x": {"config": "digits_mlp", "resources": {"gpus": -1}}}},
     "On instance['experiments']['x']['resources']['gpus']"),
    ({"experiments": {"x": {"config": "digits_mlp", "resorces": {}}}},
     "'resorces' was unexpected"),
    ({"experiments": {"x": {"overrides": []}}}, "'config' is a required property"),
    ({"experiments": {"x": {"config": "digits_mlp", "overrides": "lr=1"}}},
     "'lr=1' is not of type 'array'"),
    ({"experiments": {"bad name": {"config": "digits_mlp"}}}, "'bad name' does not match"),
    ({"experiments": {}}, "config: no experiments; list at least one under 'experiments:'"),
    ({"experiments": {"x": {"config": "digits_mlp", "resources": {"launcher": "srun"}}}},
     "config: experiments.x.resources.launcher: srun starts one task per GPU"),
    ({"sweeps": {"s": {"config": "digits_mlp", "grid": {"seed": [1]}, "resources":
                       {"launcher": "srun", "gpus": 2, "nodes": 2}}}},
     "config: sweeps.s.resources.launcher: srun runs on one node"),
    ({"experiments": {"x": {"config": "digits_mlp", "resources": {"launcher": "mpirun"}}}},
     "'mpirun' is not one of ['echelon3', 'srun']"),
])
def test_bad_config_stops_with_a_message_naming_the_key(tmp_path, bad, message):
    wf = copy_workflow(tmp_path, bad)
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n"], cwd=wf, env=env_with(),
                          text=True, capture_output=True, timeout=DRY_S)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


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


def test_sweep_keys_must_end_in_distinct_names(tmp_path):
    wf = copy_workflow(tmp_path, {"sweeps": {"s": {
        "config": "digits_mlp",
        "grid": {"optimizer.config.lr": [0.1], "scheduler.config.lr": [0.2]},
    }}})
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n"], cwd=wf, env=env_with(),
                          text=True, capture_output=True, timeout=DRY_S)
    assert proc.returncode != 0
    assert ("sweeps.s.grid: 'optimizer.config.lr' and 'scheduler.config.lr' both end in 'lr'"
            in proc.stdout + proc.stderr)


def load_report_script():
    spec = importlib.util.spec_from_file_location("report_script",
                                                  REPO / "workflow/scripts/report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_leaderboard_ranking_options(tmp_path):
    report = load_report_script()
    experiments = {"a": {"config": "x", "overrides": ["k=1"]}, "b": {"config": "y", "overrides": []},
                   "c": {"config": "z", "overrides": []}}
    files = []
    for name, metrics in (("a", {"err": 0.3, "acc": 0.5}), ("b", {"err": 0.1, "acc": 0.9}),
                          ("c", {"acc": 0.7})):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(metrics))
    # null ranks by the first metric every experiment reports
    table, metric, columns = report.leaderboard(experiments, files, None, True)
    assert metric == "acc" and columns == ["err", "acc"]
    assert list(table["experiment"]) == ["b", "c", "a"] and list(table["rank"]) == [1, 2, 3]
    table, _, _ = report.leaderboard(experiments, files, "err", False)
    assert list(table["experiment"]) == ["b", "a", "c"]  # lowest first, missing last
    assert list(table["overrides"]) == ["", "k=1", ""]
    with pytest.raises(ValueError, match="leaderboard.metric: 'f1' is in no metrics.json"):
        report.leaderboard(experiments, files, "f1", True)


# --- GPUs and nodes: command lines and SLURM --------------------------------------

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
    f"{TWO_NODE_SRUN} torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d"
    " --rdzv_endpoint $(hostname):$((29500 + SLURM_JOB_ID % 20000)) --rdzv_id $SLURM_JOB_ID"
    " --no-python echelon3 train -cd config/experiments -cn digits_cnn on_config_change=restart"
    "   target.path=results/two_nodes > logs/train/two_nodes.log 2>&1"
)
TASKS_SRUN = "srun --ntasks=2 --gpus-per-task=1 --cpus-per-task=4"
TASKS_TRAIN = (
    f"{TASKS_SRUN} echelon3 train -cd config/experiments -cn digits_mlp on_config_change=restart"
    "   target.path=results/tasks > logs/train/tasks.log 2>&1"
)
ONE_NODE_TRAIN = (
    "workflow/scripts/gpu_lock.py 2 -- echelon3 train -cd config/experiments -cn digits_mlp"
    " on_config_change=restart 'gpus=[0,1]' '~scheduler' target.path=results/one_node"
    " > logs/train/one_node.log 2>&1"
)


def test_slurm_profile_dry_run_shows_resources_and_commands(tmp_path):
    wf = copy_workflow(tmp_path)
    out = snakemake(wf, "-n", "-p", "--profile", "profiles/slurm")
    assert planned(out) == jobs_for("digits_cnn", "digits_mlp")
    for rule in ("train", "evaluate", "run"):
        res = resources_of(out, rule, "digits_cnn")
        assert {k: res[k] for k in ("slurm_partition", "slurm_account", "cpus_per_task",
                                    "mem_mb", "runtime", "nodes")} == {
            "slurm_partition": "gpu", "slurm_account": "my_account", "cpus_per_task": "2",
            "mem_mb": "4000", "runtime": "30", "nodes": "1"}
    assert ("echelon3 train -cd config/experiments -cn digits_cnn on_config_change=restart"
            " device=cpu  target.path=results/digits_cnn > logs/train/digits_cnn.log 2>&1"
            ) in shell_commands(out)
    assert ("echelon3 evaluate -cd config/experiments -cn digits_cnn device=cpu"
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
    assert ("workflow/scripts/gpu_lock.py 1 -- echelon3 run -cd config/experiments"
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


def test_slurm_plugin_submits_the_expected_sbatch_options(tmp_path):
    wf = copy_workflow(tmp_path / "wf", GPU_CONFIG)
    fakes = fake_slurm(tmp_path / "bin")
    calls = tmp_path / "sbatch.calls"
    env = env_with(SBATCH_CALLS=str(calls))
    env["PATH"] = f"{fakes}{os.pathsep}{env['PATH']}"
    out = snakemake(wf, "--profile", "profiles/slurm", "--retries", "0", "--jobs", "4",
                    "--slurm-init-seconds-before-status-checks", "1", "results/cpu/best.tar", "results/one_node/best.tar",
                    "results/two_nodes/best.tar", "results/tasks/best.tar", env=env, check=False,
                    timeout=RUN_S)
    assert "sbatch: error: refused" in out
    submitted = {re.search(r"--comment rule_train_wildcards_(\S+)", c).group(1):
                 c.split(" --wrap=")[0] for c in calls.read_text().splitlines()}
    assert set(submitted) == {"cpu", "one_node", "two_nodes", "tasks"}
    for options in submitted.values():
        assert " -p gpu " in options and " -A my_account " in options
    assert submitted["cpu"].endswith(
        "-t 30 --mem 4000 --nodes=1 --ntasks=1 --cpus-per-task=2 -D " + str(wf))
    assert submitted["one_node"].endswith(
        "-t 120 --mem 16000 --nodes=1 --cpus-per-task=8 -D " + str(wf) + " --gpus=2")
    assert submitted["two_nodes"].endswith(
        "-t 600 --mem 64000 --nodes=2 --ntasks=2 --cpus-per-task=32 -D " + str(wf)
        + " --gres=gpu:4")
    assert "--ntasks-per-gpu" not in submitted["two_nodes"] + submitted["one_node"]
    assert submitted["tasks"].endswith(
        "-t 60 --mem 4000 --nodes=1 --ntasks-per-gpu=1 --ntasks=2 --cpus-per-task=4 -D "
        + str(wf) + " --gpus=2")


def test_a_second_profile_adds_site_settings(tmp_path):
    wf = copy_workflow(tmp_path)
    site = wf / "site"
    site.mkdir()
    (site / "config.yaml").write_text(
        "default-resources:\n  slurm_partition: main\n  mem_mb: 1000\nslurm-no-account: true\n")
    out = snakemake(wf, "-n", "--profile", "profiles/slurm", "--profile", "site")
    res = resources_of(out, "train", "digits_mlp")
    assert res["slurm_partition"] == "main" and "slurm_account" not in res
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


# --- the local GPU allocator ---------------------------------------------------------


def lock_env(tmp_path, visible: str) -> dict:
    return env_with(CUDA_VISIBLE_DEVICES=visible, ECHELON3_GPU_LOCK_DIR=str(tmp_path / "locks"))


def hold_gpus(tmp_path, count: int, visible: str, name: str) -> tuple[subprocess.Popen, str]:
    """Start a job holding `count` GPUs until its release file appears; its GPUs."""
    release = tmp_path / f"release-{name}"
    script = ("import os, pathlib, time\n"
              f"print(os.environ['CUDA_VISIBLE_DEVICES'], flush=True)\n"
              f"while not pathlib.Path({str(release)!r}).exists(): time.sleep(0.05)\n")
    proc = subprocess.Popen([str(GPU_LOCK), str(count), "--", sys.executable, "-c", script],
                            env=lock_env(tmp_path, visible), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, str(release)


def test_gpu_lock_gives_side_by_side_jobs_different_gpus(tmp_path):
    first, release = hold_gpus(tmp_path, 2, "0,1,2", "first")
    try:
        got = first.stdout.readline().strip()
        assert got == "0,1"
        second = subprocess.run([str(GPU_LOCK), "1", "--", "printenv", "CUDA_VISIBLE_DEVICES"],
                                env=lock_env(tmp_path, "0,1,2"), text=True,
                                capture_output=True, timeout=30)
        assert second.returncode == 0 and second.stdout.strip() == "2"
    finally:
        Path(release).touch()
        first.wait(timeout=30)


def test_gpu_lock_waits_for_a_free_gpu(tmp_path):
    first, release = hold_gpus(tmp_path, 1, "7", "first")
    try:
        assert first.stdout.readline().strip() == "7"
        waiting = subprocess.Popen([str(GPU_LOCK), "1", "--", "printenv", "CUDA_VISIBLE_DEVICES"],
                                   env=lock_env(tmp_path, "7"), text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(2)
        assert waiting.poll() is None, "started although its only GPU is taken"
    finally:
        Path(release).touch()
        first.wait(timeout=30)
    out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 0 and out.strip() == "7"
    assert "waiting for 1 free GPU" in err


def test_gpu_lock_refuses_more_gpus_than_the_machine_has(tmp_path):
    proc = subprocess.run([str(GPU_LOCK), "3", "--", "true"], env=lock_env(tmp_path, "0,1"),
                          text=True, capture_output=True, timeout=30)
    assert proc.returncode == 2
    assert "asks for 3 GPU(s) but this machine shows 2" in proc.stderr


def test_gpu_lock_frees_the_gpu_of_a_killed_job(tmp_path):
    first, _ = hold_gpus(tmp_path, 1, "3", "first")
    assert first.stdout.readline().strip() == "3"
    first.kill()
    first.wait(timeout=30)
    proc = subprocess.run([str(GPU_LOCK), "1", "--", "printenv", "CUDA_VISIBLE_DEVICES"],
                          env=lock_env(tmp_path, "3"), text=True, capture_output=True,
                          timeout=10)
    assert proc.stdout.strip() == "3"


def test_gpu_job_trains_on_the_gpu_it_was_given(tmp_path):
    """A 1-GPU experiment while another job holds GPU 0 of two: the rule's job
    gets GPU 1 (training itself forced onto the CPU: no GPU needed here)."""
    wf = copy_workflow(tmp_path / "wf", {"experiments": {
        "g": experiment("digits_mlp", "trainer.config.epochs=1", "device=cpu", gpus=1)}})
    holder, release = hold_gpus(tmp_path, 1, "0", "holder")
    try:
        assert holder.stdout.readline().strip() == "0"
        snakemake(wf, "-j1", "results/g/best.tar", env=lock_env(tmp_path, "0,1"), timeout=RUN_S)
    finally:
        Path(release).touch()
        holder.wait(timeout=30)
    log = (wf / "logs/train/g.log").read_text()
    assert "gpu_lock: CUDA_VISIBLE_DEVICES=1" in log, log
    assert (wf / "results/g/best.tar").is_file()


# --- real runs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """The default workflow, run with `snakemake -j1` exactly as shipped."""
    wf = copy_workflow(tmp_path_factory.mktemp("default"))
    snakemake(wf, "-j1", timeout=RUN_S)
    return wf


def copy_finished(finished: Path, dest: Path) -> Path:
    """A copy of a finished run, metadata and timestamps included."""
    shutil.copytree(finished, dest, symlinks=True)
    return dest


def test_default_run_makes_every_output(finished):
    experiments = yaml.safe_load((finished / "config/config.yaml").read_text())["experiments"]
    assert set(experiments) == {"digits_cnn", "digits_mlp", "digits_mlp_ft"}
    for exp in experiments:
        folder = finished / "results" / exp
        assert (folder / "best.tar").is_file()
        metrics = json.loads((folder / "metrics.json").read_text())
        assert 0.8 < metrics["accuracy"] <= 1.0 and "macro_f1" in metrics
        with open(folder / "predictions.csv") as f:
            rows = list(csv.DictReader(f))
        assert list(rows[0]) == ["index", "prediction", *(f"score_{i}" for i in range(10))]
        assert len(rows) > 100
        png = finished / "results" / "plots" / "curves" / f"{exp}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (finished / "results/plots/metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_leaderboard_ranks_all_metrics_best_first(finished):
    with open(finished / "results/leaderboard.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["rank"] for r in rows] == ["1", "2", "3"]
    assert {r["experiment"] for r in rows} == {"digits_cnn", "digits_mlp", "digits_mlp_ft"}
    accuracies = [float(r["accuracy"]) for r in rows]
    assert accuracies == sorted(accuracies, reverse=True)
    for row in rows:
        metrics = json.loads((finished / "results" / row["experiment"] / "metrics.json").read_text())
        assert {k: float(row[k]) for k in metrics} == pytest.approx(metrics)
    md = (finished / "results/leaderboard.md").read_text()
    assert "Ranked by `accuracy`, highest first." in md
    lines = [line for line in md.splitlines() if line.startswith("|")]
    assert rows[0]["experiment"] in lines[2] and rows[1]["experiment"] in lines[3]


def test_second_dry_run_has_nothing_to_do(finished):
    out = snakemake(finished, "-n")
    assert "Nothing to be done" in out and planned(out) == set()


def test_html_report_holds_the_plots_and_leaderboard(finished, tmp_path):
    wf = copy_finished(finished, tmp_path / "wf")
    snakemake(wf, "--report", "report.html")
    html = (wf / "report.html").read_text()
    for name in ("Learning curves", "digits_cnn.png", "digits_mlp.png", "metrics.png",
                 "leaderboard.csv"):
        assert name in html


def test_editing_an_experiment_config_replans_only_its_runs(finished, tmp_path):
    wf = copy_finished(finished, tmp_path / "wf")
    cnn = wf / "config/experiments/digits_cnn.yaml"
    cnn.write_text(cnn.read_text() + "\n# edited\n")
    assert planned(snakemake(wf, "-n")) == jobs_for("digits_cnn")
    # a file both configs compose replans both
    wf2 = copy_finished(finished, tmp_path / "wf2")
    base = wf2 / "config/experiments/base/digits.yaml"
    base.write_text(base.read_text() + "\n# edited\n")
    assert planned(snakemake(wf2, "-n")) == jobs_for("digits_cnn", "digits_mlp") | CHAIN


def test_changed_resources_alone_do_not_rerun(finished, tmp_path):
    wf = copy_finished(finished, tmp_path / "wf")
    config_file = wf / "config/config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["experiments"]["digits_mlp"]["resources"].update(cpus=1, mem_mb=8000, runtime=90)
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    assert "Nothing to be done" in snakemake(wf, "-n")


def test_changed_override_retrains_exactly_that_experiment(finished, tmp_path):
    wf = copy_finished(finished, tmp_path / "wf")
    config_file = wf / "config/config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["experiments"]["digits_mlp"]["overrides"] = ["optimizer.config.lr=0.02"]
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    out = snakemake(wf, "-n")
    assert planned(out) == jobs_for("digits_mlp") | CHAIN  # the child follows its parent
    assert "Params have changed since last execution" in out

    cnn_best = wf / "results/digits_cnn/best.tar"
    cnn_mtime = cnn_best.stat().st_mtime_ns
    snakemake(wf, "-j1", timeout=RUN_S)
    log = (wf / "logs/train/digits_mlp.log").read_text()
    assert "Resuming from" not in log, "retrained from the old checkpoints"
    assert list((wf / "results/digits_mlp").glob("superseded-*/checkpoint-*.tar"))
    saved = yaml.safe_load((wf / "results/digits_mlp/config.yaml").read_text())
    assert saved["optimizer"]["config"]["lr"] == 0.02
    assert cnn_best.stat().st_mtime_ns == cnn_mtime
    child = (wf / "logs/train/digits_mlp_ft.log").read_text()
    assert "config changed since" in child and "starting over" in child  # new parent weights
    assert "Nothing to be done" in snakemake(wf, "-n")


def test_killed_train_job_resumes_from_its_last_checkpoint(tmp_path):
    """Kill the training process (the job fails), then kill Snakemake and all
    below it (no clean-up at all); each rerun continues from the newest
    rolling checkpoint."""
    wf = copy_workflow(tmp_path, {"experiments": {
        "mlp": experiment("digits_mlp", "trainer.config.epochs=60")}})
    folder = wf / "results/mlp"
    log = wf / "logs/train/mlp.log"

    # 1. the training process dies: Snakemake marks the job failed
    first = subprocess.Popen([sys.executable, "-m", "snakemake", "-j1"], cwd=wf, env=env_with(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        wait_for(lambda: checkpoint_epochs(folder), RUN_S, "a first checkpoint", first)
        trainers = [p for p in descendants(first.pid) if "echelon3 train" in cmdline(p)]
        assert trainers, "no echelon3 process below snakemake"
        for pid in reversed(trainers):  # deepest first: the python process, then its shell
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert first.wait(timeout=DRY_S) != 0
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    kept = checkpoint_epochs(folder)
    assert kept and max(kept) < 60, kept

    # 2. the rerun resumes; then Snakemake and everything below it is killed
    second = subprocess.Popen([sys.executable, "-m", "snakemake", "-j1"], cwd=wf,
                              env=env_with(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: max(checkpoint_epochs(folder) or [0]) > max(kept), RUN_S,
                 "a checkpoint after the resume", second)
        os.killpg(second.pid, signal.SIGKILL)
        second.wait(timeout=DRY_S)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    assert resumed_epoch(log) == max(kept)
    kept_again = checkpoint_epochs(folder)
    assert max(kept_again) < 60, "training ended before the kill"

    # 3. a hard kill leaves the folder locked and the output incomplete:
    #    unlock, and the local profile reruns incomplete jobs
    snakemake(wf, "--unlock")
    snakemake(wf, "--profile", "profiles/local", "--cores", "1", timeout=RUN_S)
    assert resumed_epoch(log) >= max(kept_again)
    assert checkpoint_epochs(folder)[-1] == 60
    assert (folder / "best.tar").is_file() and (folder / "metrics.json").is_file()
    history = (folder / "history.jsonl").read_text().splitlines()
    epochs = {json.loads(line)["epoch"] for line in history if line.strip()}
    assert epochs == set(range(1, 61))
    assert "Nothing to be done" in snakemake(wf, "-n")


# --- finetune and export edges -----------------------------------------------------------


def job_body(output: str, rule: str, exp: str) -> str:
    for name, body in JOB.findall(output):
        if name == rule and re.search(rf"wildcards: exp={re.escape(exp)}\b", body):
            return body
    raise AssertionError(f"no {rule} job for {exp} in:\n{output[-3000:]}")


def test_finetuned_sweep_and_exports_depend_on_their_parent(tmp_path):
    wf = copy_workflow(tmp_path, {
        "experiments": {"base": experiment("digits_mlp")},
        "sweeps": {"ft": {"config": "digits_mlp_ft", "init_from": "base",
                          "export": ["onnx", "safetensors"],
                          "grid": {"optimizer.config.lr": [0.01, 0.02]}}}})
    out = snakemake(wf, "-n", "-p")
    points = ["ft/lr~0.01", "ft/lr~0.02"]
    assert planned(out) == jobs_for("base") | {
        (rule, p) for p in points for rule in ("finetune", "evaluate", "run", "export")}
    for point in points:
        body = job_body(out, "finetune", point)
        assert re.search(r"input: .*results/base/best\.tar", body), body
        (command,) = [c for c in shell_commands(out)
                      if c.startswith("echelon3 train") and f"results/{point}'" in c]
        assert "init_from.checkpoint=results/base/best.tar" in command
        exports = [b for name, b in JOB.findall(out) if name == "export" and point in b]
        assert {re.search(r"output: (\S+)", b).group(1) for b in exports} == {
            f"results/{point}/model.onnx", f"results/{point}/model.safetensors"}


@pytest.mark.parametrize("experiments, message", [
    ({"a": {"config": "digits_mlp_ft", "init_from": "b"},
      "b": {"config": "digits_mlp_ft", "init_from": "c"},
      "c": {"config": "digits_mlp_ft", "init_from": "a"}},
     "config: init_from makes a cycle: a -> b -> c -> a"),
    ({"a": {"config": "digits_mlp_ft", "init_from": "a"}}, "init_from makes a cycle: a -> a"),
    ({"a": {"config": "digits_mlp_ft", "init_from": "nope"}},
     "config: experiments.a.init_from: no experiment named 'nope'"),
])
def test_init_from_cycles_and_unknown_parents_are_refused(tmp_path, experiments, message):
    wf = copy_workflow(tmp_path, {"experiments": experiments})
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n"], cwd=wf, env=env_with(),
                          text=True, capture_output=True, timeout=DRY_S)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


def test_default_chain_finetunes_after_its_parent_and_exports(finished):
    parent = finished / "results/digits_mlp/best.tar"
    child = finished / "results/digits_mlp_ft"
    log = (finished / "logs/train/digits_mlp_ft.log").read_text()
    assert "init_from results/digits_mlp/best.tar: loaded 4 tensors, skipped 0, missing 0" in log
    assert "finetune: 8320 of 9610 parameter values frozen" in log  # layers.1: 64x128 + 128
    assert parent.stat().st_mtime < (child / "config.yaml").stat().st_mtime  # DAG order
    onnxruntime = pytest.importorskip("onnxruntime", reason="needs the 'export' extra")
    session = onnxruntime.InferenceSession(str(child / "model.onnx"))
    probabilities = session.run(None, {session.get_inputs()[0].name:
                                       __import__("numpy").zeros((3, 1, 8, 8), "float32")})[0]
    assert probabilities.shape == (3, 10) and abs(probabilities.sum(1) - 1).max() < 1e-5
    with open(finished / "results/leaderboard.csv") as f:
        models = {r["experiment"]: r["model"] for r in csv.DictReader(f)}
    assert models == {"digits_cnn": "", "digits_mlp": "", "digits_mlp_ft":
                      "results/digits_mlp_ft/model.onnx"}
    assert "[model.onnx](digits_mlp_ft/model.onnx)" in (
        finished / "results/leaderboard.md").read_text()


def test_new_parent_weights_rerun_its_child(finished, tmp_path):
    """As a retrained parent leaves it: best.tar with other weights (a touch alone is not
    enough: Snakemake compares the checksum of a small input whose mtime changed)."""
    import torch

    wf = copy_finished(finished, tmp_path / "wf")
    best = wf / "results/digits_mlp/best.tar"
    state = torch.load(best, weights_only=True)
    state["model_state_dict"] = {k: v + 0.01 for k, v in state["model_state_dict"].items()}
    best.unlink()
    torch.save(state, best)
    out = snakemake(wf, "-n")
    parent_downstream = {("evaluate", "digits_mlp"), ("run", "digits_mlp")}  # not its train
    assert planned(out) == CHAIN | parent_downstream | {("report", None), ("all", None)}
