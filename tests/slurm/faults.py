"""What goes wrong on a cluster, done to a running job of the test cluster: a node lost
(its part of the job step killed), a preemption signal (`scancel --signal`), and the
timing of the job's end."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.slurm.cluster import SlurmCluster

POLL_S = 0.1


def running_job(cluster: SlurmCluster, comment: str) -> str | None:
    """The id of the running job whose comment is ``comment`` (Snakemake's
    ``rule_<rule>_wildcards_<value>``), or None."""
    out = cluster.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i %k"], check=False).stdout
    for line in out.splitlines():
        job, _, text = line.partition(" ")
        if text.strip() == comment:
            return job
    return None


def experiment_job(cluster: SlurmCluster, exp: str) -> str | None:
    """The id of the running job that trains ``exp``: its own train job, or the job of
    its group (``rule_exp_<exp>_<rules>``, one job per experiment), or None."""
    out = cluster.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i %k"], check=False).stdout
    for line in out.splitlines():
        job, _, text = line.partition(" ")
        if text.strip() == f"rule_train_wildcards_{exp}" or \
                text.strip().startswith(f"rule_exp_{exp}_"):
            return job
    return None


def job_ended(cluster: SlurmCluster, job: str) -> bool:
    """No longer running: finished, failed, or gone from the queue."""
    out = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip()
    return out not in ("RUNNING", "COMPLETING", "PENDING", "CONFIGURING")


def wait_job_end(cluster: SlurmCluster, job: str, timeout: float) -> float:
    """Seconds until the job ended (raises AssertionError after ``timeout``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if job_ended(cluster, job):
            return time.monotonic() - start
        time.sleep(POLL_S)
    raise AssertionError(f"job {job} still running {timeout} s later")


def _job_of(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"SLURM_JOB_ID="):
            return item.split(b"=", 1)[1].decode()
    return None


def kill_step_on_node(job: str, namespace: str) -> list[int]:
    """SIGKILL every process of ``job`` that runs in the node's network namespace,
    except slurmstepd: what remains of a job step when its node dies. -> the pids."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                          timeout=10, check=True).stdout.split()
    killed = []
    for pid in map(int, pids):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm != "slurmstepd" and _job_of(pid) == job:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def signal_job(cluster: SlurmCluster, job: str, name: str) -> None:
    """``scancel --signal=NAME``: the signal goes to every process of the job's steps."""
    cluster.run(["scancel", f"--signal={name}", job])
