"""Multi-node for real: the workflow on the two-node test cluster, through
`snakemake --profile slurm` by its bare name (after `echelon3 profiles install`) and a site
profile on top. One Snakemake run trains five copies of one tiny run, each with 2 ranks on
2 nodes (CPU, gloo):

- ``torchrun``  srun + torchrun (c10d rendezvous), left alone: the reference;
- ``srun``      `launcher: srun`, one SLURM task per rank, left alone;
- ``nodeloss``  torchrun; in epoch 2 the job step's processes on the second node are killed;
- ``term``      torchrun; in epoch 2 `scancel --signal=TERM`;
- ``usr1``      `launcher: srun`; in epoch 2 `scancel --signal=USR1`.

Snakemake's retry resubmits the three interrupted jobs, and each must end with the
reference's weights, RNG states and history.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from echelon3 import cli
from tests.conftest import probe_config, run_cli
from tests.helpers import without_clock
from tests.probe import ProbeNet
from tests.slurm import faults
from tests.slurm.cluster import run_bounded
from tests.workflow.helpers import copy_workflow

pytestmark = pytest.mark.slurm

EPOCHS, STEPS = 3, 8  # 64 samples, global batch 8
NET = {"dropout": 0.3, "sleep": 0.3}  # slow enough to land a fault in epoch 2
SNAKEMAKE_S = 300  # the whole run, retries included
JOB_END_LIMIT_S = 30  # SLURM's default KillWait; the process-group timeout is 30 min
NODE2_NS = "e3slurm-e3node2"

LAUNCHERS = {"torchrun": "echelon3", "srun": "srun", "nodeloss": "echelon3",
             "term": "echelon3", "usr1": "srun"}
FAULTS = {"nodeloss": "kill", "term": "TERM", "usr1": "USR1"}
SITE_PROFILE = {
    "default-resources": {"slurm_partition": "main", "mem_mb": 500, "runtime": 10,
                          "cpus_per_task": 1},
    "slurm-status-command": "squeue",
    "slurm-init-seconds-before-status-checks": 2,
    "slurm-no-account": True,
    "retries": 1,
}


def _experiments() -> dict:
    return {name: {"config": name, "overrides": [],
                   "resources": {"nodes": 2, "gpus": 0, "cpus": 1, "mem_mb": 500,
                                 "runtime": 10, "launcher": launcher}}
            for name, launcher in LAUNCHERS.items()}


class Faults:
    """One thread per faulty experiment: once its rank 0 trains in epoch 2, do the fault,
    time the job's end and keep that attempt's train log (the retry overwrites it)."""

    def __init__(self, cluster, wf: Path, probes: Path, keep: Path):
        self.cluster, self.wf, self.probes, self.keep = cluster, wf, probes, keep
        self.seconds: dict[str, float] = {}
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._guard, args=(exp,), daemon=True)
                        for exp in FAULTS]

    def start(self):
        for thread in self.threads:
            thread.start()

    def _in_epoch_2(self, exp: str) -> bool:
        log = self.probes / exp / "probe" / "rank0.jsonl"
        return log.exists() and len(log.read_text().splitlines()) > STEPS + 1

    def _guard(self, exp: str) -> None:
        try:
            self._inject(exp)
        except Exception as e:  # reported by the test, not lost in a thread
            self.errors.append(f"{exp}: {type(e).__name__}: {e}")

    def _inject(self, exp: str) -> None:
        end = time.monotonic() + SNAKEMAKE_S
        while not self._in_epoch_2(exp):
            if time.monotonic() > end:
                raise AssertionError("epoch 2 never began")
            time.sleep(0.05)
        job = faults.experiment_job(self.cluster, exp)
        assert job, "no running job"
        if FAULTS[exp] == "kill":
            assert faults.kill_step_on_node(job, NODE2_NS), "nothing of the job on node 2"
        else:
            faults.signal_job(self.cluster, job, FAULTS[exp])
        self.seconds[exp] = faults.wait_job_end(self.cluster, job, JOB_END_LIMIT_S * 2)
        shutil.copy2(self.wf / "logs" / "train" / f"{exp}.log", self.keep / f"{exp}.log")


@pytest.fixture(scope="module")
def multinode(slurm_two_nodes, tmp_path_factory):
    """The run, once: (workflow folder, first attempts' train logs, job-end seconds)."""
    tmp = tmp_path_factory.mktemp("multinode")
    wf = copy_workflow(tmp / "wf", {"experiments": _experiments()})
    for name in LAUNCHERS:
        config = probe_config(tmp / "probes" / name, name, epochs=EPOCHS, net=NET, extra={
            "trainer": {"config": {"epochs": EPOCHS, "precision": "fp32",
                                   "log_every_n_steps": 3, "progress_bar": False}}})
        shutil.copy2(config, wf / "config" / "experiments" / f"{name}.yaml")
    site = tmp / "site"
    site.mkdir()
    (site / "config.yaml").write_text(yaml.safe_dump(SITE_PROFILE))
    env = {**slurm_two_nodes.env, "XDG_CONFIG_HOME": str(tmp / "xdg"),
           "PYTHONUNBUFFERED": "1"}
    installed = run_cli(["profiles", "install"], cwd=wf, env=env, timeout=60)
    assert installed.returncode == 0, installed.stderr
    (tmp / "first").mkdir()
    faulty = Faults(slurm_two_nodes, wf, tmp / "probes", tmp / "first")
    faulty.start()
    targets = [f"results/{name}/best.tar" for name in LAUNCHERS]
    args = [sys.executable, "-m", "snakemake", "--profile", "slurm", "--profile", str(site),
            *targets]
    try:
        proc = run_bounded(args, SNAKEMAKE_S, env=env, cwd=wf)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"snakemake still running after {e.timeout} s\n{str(e.stderr)[-5000:]}"
                    f"\n{_logs(wf)}\n{slurm_two_nodes.logs()}")
    for thread in faulty.threads:
        thread.join(timeout=10)
    assert proc.returncode == 0, f"{proc.stderr[-6000:]}\n{_logs(wf)}"
    assert not faulty.errors, f"{faulty.errors}\n{_logs(wf)}"
    print(f"\nmulti-node job end after the fault, seconds: {json.dumps(faulty.seconds)}")
    return wf, tmp / "first", faulty.seconds


def _logs(wf: Path) -> str:
    return "".join(f"\n--- {p}\n{p.read_text(errors='replace')[-2500:]}"
                   for p in sorted(wf.glob("logs/**/*.log")))


def _final(wf: Path, exp: str) -> dict:
    return torch.load(wf / "results" / exp / f"checkpoint-{EPOCHS}.tar", weights_only=True)


def _history(wf: Path, exp: str) -> list[dict]:
    """Train and validation records (time records hold wall-clock figures)."""
    text = (wf / "results" / exp / "history.jsonl").read_text()
    return without_clock(list(map(json.loads, text.splitlines())))


def _jobs(wf: Path, exp: str) -> list[str]:
    """The SLURM jobs that trained ``exp``: its train jobs, or its group's (one job per
    experiment)."""
    logs = [*wf.glob(f"logs/slurm/rule_train/{exp}/*.log"),
            *wf.glob(f"logs/slurm/group_exp_{exp}_*/*.log")]
    return sorted(p.stem for p in logs)


@pytest.mark.parametrize("exp", ["torchrun", "srun"])
def test_both_launch_paths_run_one_rank_on_each_node(multinode, exp):
    wf, _, _ = multinode
    log = (wf / "logs" / "train" / f"{exp}.log").read_text()
    ranks = re.search(r"ranks: 0 on (\S+), 1 on (\S+)$", log, re.MULTILINE)
    assert ranks and set(ranks.groups()) == {"e3node1", "e3node2"}, log[-3000:]
    assert "training on cpu x2" in log
    assert len(_jobs(wf, exp)) == 1
    best = torch.load(wf / "results" / exp / "best.tar", weights_only=True)
    assert sorted(best["model_state_dict"]) == ["fc.bias", "fc.weight"]  # no module. prefix
    ProbeNet().load_state_dict(best["model_state_dict"])  # strict
    # the trainer's validation at best.tar's step equals a single-process evaluate of it
    out = wf / "results" / exp / "single.json"
    assert cli.main(["evaluate", "-cd", str(wf / "config" / "experiments"), "-cn", exp,
                     "device=cpu", f"target.path={wf / 'results' / exp}",
                     f"evaluator.config.output={out}"]) == 0
    single = json.loads(out.read_text())
    (validated,) = [r for r in _history(wf, exp)
                    if r["split"] == "val" and r["step"] == best["global_step"]]
    scores = [k for k in single if k not in ("loss", "selected_on")]
    assert single["selected_on"] == "test"  # this experiment has no validation set
    assert {k: validated[k] for k in scores} == {k: single[k] for k in scores}
    assert validated["loss"] == pytest.approx(single["loss"], rel=1e-6)


@pytest.mark.parametrize("exp", ["srun", *FAULTS])
def test_every_run_ends_with_the_references_weights(multinode, exp):
    wf, _, _ = multinode
    ref, mine = _final(wf, "torchrun"), _final(wf, exp)
    assert mine["global_step"] == EPOCHS * STEPS
    for key, value in ref["model_state_dict"].items():
        assert torch.equal(mine["model_state_dict"][key], value), key
    for theirs, ours in zip(ref["rng_states"], mine["rng_states"], strict=True):
        assert torch.equal(theirs["torch"], ours["torch"])
    assert _history(wf, exp) == _history(wf, "torchrun")
    assert not list((wf / "results" / exp).glob("checkpoint-*-step*.tar"))


def test_a_lost_node_fails_the_job_in_seconds_and_the_retry_resumes(multinode):
    wf, first, seconds = multinode
    assert seconds["nodeloss"] < JOB_END_LIMIT_S, seconds
    lost = re.search(r"lost rank (\d) on e3node2 \(10\.213\.77\.12\): its process or node "
                     r"is gone", (first / "nodeloss.log").read_text())
    assert lost, (first / "nodeloss.log").read_text()[-3000:]
    assert len(_jobs(wf, "nodeloss")) == 2  # Snakemake resubmitted it once
    retry = (wf / "logs" / "train" / "nodeloss.log").read_text()
    assert re.search(r"Resuming from \S+/checkpoint-1\.tar \(epoch 1, step 8\)", retry), retry


@pytest.mark.parametrize("exp,sig", [("term", "SIGTERM"), ("usr1", "SIGUSR1")])
def test_a_preempted_job_checkpoints_its_step_and_the_retry_resumes_there(multinode, exp,
                                                                          sig):
    wf, first, seconds = multinode
    assert seconds[exp] < JOB_END_LIMIT_S, seconds
    stopped = re.search(rf"preempted \({sig}\) at epoch 2 step (\d+): checkpoint \S+ "
                        r"written, ([0-9.]+) s after the signal; exiting 75",
                        (first / f"{exp}.log").read_text())
    assert stopped, (first / f"{exp}.log").read_text()[-3000:]
    step = int(stopped.group(1))
    assert STEPS < step < 2 * STEPS
    assert len(_jobs(wf, exp)) == 2
    retry = (wf / "logs" / "train" / f"{exp}.log").read_text()
    assert re.search(rf"Resuming from \S+/checkpoint-1-step{step}\.tar \(epoch 1, step "
                     rf"{step}\)", retry), retry
