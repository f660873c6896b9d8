"""The workflow on a real SLURM cluster: `--profile profiles/slurm` on the local
one-node cluster of tests/slurm (two fake GPUs), with a site profile on top
for what that cluster needs (partition, squeue status checks, no account).

One Snakemake run trains, evaluates and runs the two digits experiments on the
CPU (one of them also exported) and a probe experiment with `launcher: srun` and
two GPUs: two srun tasks, one fake GPU each, training one DDP run with gloo on
the CPU. Each experiment is one SLURM job (one Snakemake group). One of them is
preempted in training (SIGTERM to its job, as SLURM sends it) and submitted
again. The test then checks every output, the submissions slurmctld took (one
per experiment and attempt), the resources SLURM gave each job (`scontrol show
job`; finished jobs stay visible for the cluster's MinJobAge of 300 s), the
preempted run's resume and what the two ranks saw.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.conftest import probe_config
from tests.slurm.cluster import parse_tres, run_bounded
from tests.slurm.faults import running_job, signal_job
from tests.workflow.helpers import copy_workflow

pytestmark = pytest.mark.slurm

SNAKEMAKE_S = 150  # the whole run; about 60 s on a 2-core machine

# What the local cluster needs, kept out of the shipped profile: its partition,
# status checks through squeue (no accounting, so sacct would hang), no account,
# and one retry: the preempted experiment's second attempt.
SITE_PROFILE = {
    "default-resources": {"slurm_partition": "main", "mem_mb": 1000, "runtime": 10,
                          "cpus_per_task": 1},
    "slurm-status-command": "squeue",
    "slurm-init-seconds-before-status-checks": 2,
    "slurm-no-account": True,
    "retries": 1,
}

# One CPU per digits job, so that both fit beside each other on a 2-core node;
# memory and runtime differ per experiment to tell the jobs' resources apart.
EXPERIMENTS = {
    "digits_cnn": {"config": "digits_cnn", "overrides": ["trainer.config.epochs=3"],
                   "resources": {"gpus": 0, "cpus": 1, "mem_mb": 900, "runtime": 7}},
    "digits_mlp": {"config": "digits_mlp", "overrides": ["trainer.config.epochs=2"],
                   "export": ["safetensors"],
                   "resources": {"gpus": 0, "cpus": 1, "mem_mb": 800, "runtime": 9}},
    "ranks": {"config": "ranks", "overrides": ["device=cpu"],
              "resources": {"gpus": 2, "cpus": 2, "mem_mb": 1000, "runtime": 5,
                            "launcher": "srun"}},
}

# The rules of each experiment's one job (its Snakemake group), as the job's name
# lists them.
GROUP_RULES = {"digits_cnn": "evaluate_run_train", "digits_mlp": "evaluate_export_run_train",
               "ranks": "evaluate_run_train"}

# experiment -> what scontrol must show of its job: CPUs, memory, time limit, GPUs;
# train's own (`launcher: srun`: all GPUs), whatever evaluate, run and export ask.
EXPECTED = {
    "digits_cnn": (1, "900M", "00:07:00", 0),
    "digits_mlp": (1, "800M", "00:09:00", 0),
    "ranks": (2, "1000M", "00:05:00", 2),
}

SUBMITTED = re.compile(r"_slurm_rpc_submit_batch_job: JobId=(\d+)")

PREEMPTED = "digits_cnn"  # its job gets SIGTERM once its training logged epoch 1


def job_name(exp: str) -> str:
    """The SLURM comment of an experiment's job: `rule_<group name>`."""
    return f"rule_exp_{exp}_{GROUP_RULES[exp]}"


def preempt_in_training(cluster, wf: Path, done: threading.Event, signalled: list) -> None:
    """SIGTERM to the PREEMPTED experiment's job, as a preemption sends it, once its
    train log shows the first epoch (the job id goes to `signalled`)."""
    log = wf / "logs/train" / f"{PREEMPTED}.log"
    while not done.is_set():
        if log.is_file() and "epoch 1 step" in log.read_text(errors="replace"):
            job = running_job(cluster, job_name(PREEMPTED))
            if job is not None:
                signal_job(cluster, job, "TERM")
                signalled.append(job)
                return
        time.sleep(0.05)


@pytest.fixture(scope="module")
def slurm_run(slurm_cluster, tmp_path_factory):
    """The workflow, run once on the cluster: (workflow folder, probe log folder,
    ids of the batch jobs slurmctld took)."""
    tmp = tmp_path_factory.mktemp("slurm-workflow")
    wf = copy_workflow(tmp / "wf", {"experiments": EXPERIMENTS,
                                    "leaderboard": {"metric": "accuracy"}})
    probe = probe_config(tmp / "ranks", "ranks", epochs=2)
    shutil.copy2(probe, wf / "config" / "experiments" / "ranks.yaml")
    site = tmp / "site"
    site.mkdir()
    (site / "config.yaml").write_text(yaml.safe_dump(SITE_PROFILE))
    env = {**slurm_cluster.env, "PYTHONUNBUFFERED": "1"}
    ctld_log = slurm_cluster.dir / "log/ctld/slurmctld.log"
    ctld_start = ctld_log.stat().st_size
    args = [sys.executable, "-m", "snakemake", "--profile", "profiles/slurm",
            "--profile", str(site)]
    done, signalled = threading.Event(), []
    watcher = threading.Thread(target=preempt_in_training,
                               args=(slurm_cluster, wf, done, signalled), daemon=True)
    watcher.start()
    try:
        proc = run_bounded(args, SNAKEMAKE_S, env=env, cwd=wf)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"snakemake still running after {e.timeout} s\n{str(e.stdout)[-6000:]}"
                    f"{str(e.stderr)[-6000:]}{job_logs(wf)}\n{slurm_cluster.logs()}")
    finally:
        done.set()
        watcher.join()
    assert signalled, f"{PREEMPTED} was never seen training\n{job_logs(wf)}"
    assert proc.returncode == 0, (f"snakemake exited {proc.returncode}\n{proc.stdout[-6000:]}"
                                  f"{proc.stderr[-6000:]}{job_logs(wf)}")
    submitted = SUBMITTED.findall(ctld_log.read_bytes()[ctld_start:].decode(errors="replace"))
    return wf, tmp / "ranks" / "probe", submitted


def job_logs(wf: Path) -> str:
    """Tails of the rules' and SLURM's logs, for failure messages."""
    return "".join(f"\n--- {p}\n{p.read_text(errors='replace')[-3000:]}"
                   for p in sorted(wf.glob("logs/**/*.log")))


def submitted_jobs(wf: Path) -> dict[str, list[str]]:
    """Job name (`rule_<group name>`) -> SLURM job ids, from the plugin's log files
    logs/slurm/group_<group name>/<job id>.log."""
    jobs: dict[str, list[str]] = {}
    for log in wf.glob("logs/slurm/group_*/*.log"):
        jobs.setdefault("rule_" + log.parent.name.removeprefix("group_"), []).append(log.stem)
    return jobs


def test_every_output_is_made(slurm_run):
    wf, _, _ = slurm_run
    for exp in EXPERIMENTS:
        folder = wf / "results" / exp
        assert (folder / "best.tar").is_file()
        metrics = json.loads((folder / "metrics.json").read_text())
        assert 0.0 <= metrics["accuracy"] <= 1.0, metrics
        with open(folder / "predictions.csv") as f:
            rows = list(csv.DictReader(f))
        assert rows and "prediction" in rows[0], rows[:1]
        png = wf / "results" / "plots" / "curves" / f"{exp}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (wf / "results/plots/metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(wf / "results/leaderboard.csv") as f:
        assert {row["experiment"] for row in csv.DictReader(f)} == set(EXPERIMENTS)
    assert "Ranked by `test accuracy`" in (wf / "results/leaderboard.md").read_text()
    assert (wf / "results/digits_mlp/model.safetensors").stat().st_size > 0


def test_one_submission_per_experiment(slurm_run, slurm_cluster):
    """slurmctld took one batch job per experiment (not one per rule), and one more
    for the preempted one; each ran all of its experiment's jobs: train, evaluate,
    run (and export)."""
    wf, _, submitted = slurm_run
    names = Counter(slurm_cluster.scontrol_job(job)["Comment"] for job in submitted)
    assert names == {job_name(exp): 1 + (exp == PREEMPTED) for exp in EXPERIMENTS}, \
        (submitted, names)
    jobs = submitted_jobs(wf)
    for exp, rules in GROUP_RULES.items():
        last = max(jobs[job_name(exp)], key=int)
        text = (wf / f"logs/slurm/group_exp_{exp}_{rules}/{last}.log").read_text()
        ran = re.findall(r"^Finished jobid: \d+ \(Rule: (\w+)\)$", text, re.M)
        assert sorted(set(ran)) == rules.split("_"), (exp, ran, text[-3000:])


def test_a_preempted_group_resumes_training_then_runs_the_rest(slurm_run, slurm_cluster):
    """The preempted job's train stopped with a checkpoint and the job failed before
    evaluate and run; the second job continued training from that checkpoint (the
    epochs before it not trained again, no step logged twice), then ran the rest."""
    wf, _, _ = slurm_run
    first, _ = sorted(submitted_jobs(wf)[job_name(PREEMPTED)], key=int)
    assert slurm_cluster.scontrol_job(first)["JobState"] == "FAILED"
    first_log = (wf / f"logs/slurm/group_exp_{PREEMPTED}_{GROUP_RULES[PREEMPTED]}"
                 / f"{first}.log").read_text()
    assert "Error in rule train" in first_log and "(Rule: evaluate)" not in first_log, \
        first_log[-3000:]
    train_log = (wf / "logs/train" / f"{PREEMPTED}.log").read_text()
    resumed = re.search(r"Resuming from \S*checkpoint-(\d+)(?:-step\d+)?\.tar", train_log)
    assert resumed, train_log
    folder = wf / "results" / PREEMPTED
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["epochs"] == 3, summary
    assert summary["epochs_trained"] == 3 - int(resumed.group(1)), (summary, resumed[0])
    history = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in history if r["split"] == "train"]
    assert steps == sorted(set(steps)), steps
    assert [r["epoch"] for r in history if r["split"] == "val"] == [1, 2, 3], history
    assert json.loads((folder / "metrics.json").read_text())["accuracy"] > 0


def test_each_job_got_the_resources_its_experiment_asked_for(slurm_run, slurm_cluster):
    wf, _, _ = slurm_run
    jobs = submitted_jobs(wf)
    # one job per experiment and attempt; report runs where Snakemake runs
    assert set(jobs) == {job_name(exp) for exp in EXPERIMENTS}, jobs
    for exp, (cpus, mem, limit, gpus) in EXPECTED.items():
        ids = sorted(jobs[job_name(exp)], key=int)
        assert len(ids) == 1 + (exp == PREEMPTED), (exp, ids)
        for job_id in ids:
            job = slurm_cluster.scontrol_job(job_id)
            where = f"{exp} (job {job_id}): {job}"
            assert job["Comment"] == job_name(exp), where
            assert Path(job["WorkDir"]) == wf, where
            assert job["Partition"] == "main", where
            assert (job["NumNodes"], job["NumCPUs"], job["MinMemoryNode"],
                    job["TimeLimit"]) == ("1", str(cpus), mem, limit), where
            tres = parse_tres(job["TRES"])
            assert (tres["cpu"], tres["mem"]) == (str(cpus), mem), where
            # without accounting of gres/gpu, TRES leaves GPUs out; TresPerJob has them
            assert job.get("TresPerJob") == (f"gres:gpu:{gpus}" if gpus else None), where
        assert slurm_cluster.scontrol_job(ids[-1])["JobState"] == "COMPLETED", exp
    # one task per GPU, each with its share of the CPUs
    (ranks,) = jobs[job_name("ranks")]
    train = slurm_cluster.scontrol_job(ranks)
    assert (train["NumTasks"], train["CPUs/Task"], train["NtasksPerTRES"]) == \
        ("2", "1", "1"), train


def test_srun_launcher_runs_one_rank_per_gpu(slurm_run):
    wf, probe, _ = slurm_run
    seen, first_epoch = {}, {}
    for rank in (0, 1):
        text = (probe / f"rank{rank}.jsonl").read_text()
        lines = [json.loads(line) for line in text.splitlines()]
        assert lines and len(lines) % 2 == 0, lines  # the same steps in each of 2 epochs
        assert {(r["rank"], r["world"]) for r in lines} == {(rank, 2)}, lines[:2]
        (seen[rank],) = {r["cuda_visible"] for r in lines}
        first_epoch[rank] = {i for r in lines[:len(lines) // 2] for i in r["batch"]}
    assert sorted(seen.values()) == ["0", "1"], seen
    assert not list(probe.glob("rank[2-9]*.jsonl"))
    # one run: the ranks share out the training set
    assert first_epoch[0] and not first_epoch[0] & first_epoch[1], first_epoch
    assert "training on cpu x2" in (wf / "logs/train/ranks.log").read_text()
