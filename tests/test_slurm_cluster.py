"""The local SLURM test cluster works as the workflow tests expect: GPUs are
handed out, ranks see their variables, requested resources are recorded, and
Snakemake's SLURM executor plugin runs a workflow on it."""

import subprocess
import sys
from pathlib import Path

import pytest

# The fixture, also when tests/conftest.py does not provide it; both share one
# cluster per session.
from tests.slurm.cluster import slurm_cluster  # noqa: F401
from tests.slurm.cluster import SNAKEMAKE_SLURM_ARGS, parse_tres, run_bounded

JOB_TIMEOUT_S = 60
SNAKEMAKE_TIMEOUT_S = 240

pytestmark = pytest.mark.slurm


def _report_values(text):
    """Lines of ``key=value key=value`` -> list of dicts."""
    return [
        dict(word.split("=", 1) for word in line.split())
        for line in text.splitlines()
        if "=" in line
    ]


def test_batch_job_gets_one_gpu(slurm_cluster, tmp_path):
    out = tmp_path / "job.out"
    slurm_cluster.run(
        [
            "sbatch",
            "--wait",
            "--gpus=1",
            "--time=1",
            f"--output={out}",
            "--wrap",
            "echo cvd=${CUDA_VISIBLE_DEVICES-unset} job_gpus=${SLURM_JOB_GPUS-unset}",
        ],
        timeout=JOB_TIMEOUT_S,
        cwd=tmp_path,
    )
    (report,) = _report_values(out.read_text())
    assert report["cvd"] == "0"
    assert report["job_gpus"] != "unset"


RANKS_SCRIPT = """\
#!/bin/bash
srun -n2 --gpus-per-task=1 bash -c \\
  'echo rank=$SLURM_PROCID local=$SLURM_LOCALID ntasks=$SLURM_NTASKS cvd=${CUDA_VISIBLE_DEVICES-unset}'
"""


def test_two_tasks_get_one_gpu_each(slurm_cluster, tmp_path):
    script = tmp_path / "ranks.sh"
    script.write_text(RANKS_SCRIPT)
    out = tmp_path / "ranks.out"
    slurm_cluster.run(
        [
            "sbatch",
            "--wait",
            "--nodes=1",  # both fake GPUs of one node
            "--ntasks=2",
            "--cpus-per-task=1",
            "--gpus-per-task=1",
            "--time=1",
            f"--output={out}",
            str(script),
        ],
        timeout=JOB_TIMEOUT_S,
        cwd=tmp_path,
    )
    reports = sorted(_report_values(out.read_text()), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == ["0", "1"], out.read_text()
    assert sorted(r["local"] for r in reports) == ["0", "1"]
    assert all(r["ntasks"] == "2" for r in reports)
    devices = [r["cvd"] for r in reports]
    assert "unset" not in devices and len(set(devices)) == 2, devices


def test_scontrol_reports_requested_resources(slurm_cluster, tmp_path):
    result = slurm_cluster.run(
        [
            "sbatch",
            "--wait",
            "--parsable",
            "--cpus-per-task=2",
            "--mem=300M",
            "--time=7",
            "--gpus=1",
            "--output=/dev/null",
            "--wrap",
            "true",
        ],
        timeout=JOB_TIMEOUT_S,
        cwd=tmp_path,
    )
    jobid = result.stdout.strip().split(";")[0]
    job = slurm_cluster.scontrol_job(jobid)
    assert job["JobState"] == "COMPLETED", job
    assert job["NumCPUs"] == "2"
    assert job["TimeLimit"] == "00:07:00"
    assert job["MinMemoryNode"] == "300M"
    tres = parse_tres(job["TRES"])
    assert tres["cpu"] == "2" and tres["mem"] == "300M", tres
    assert "gpu:1" in job["TresPerJob"]


SNAKEFILE = """\
localrules: all

rule all:
    input:
        "out/cpu.txt",
        "out/gpu.txt",

rule cpu:
    output:
        "out/cpu.txt",
    resources:
        runtime=5,
        mem_mb=200,
        cpus_per_task=1,
    shell:
        "echo job=$SLURM_JOB_ID > {output}"

rule gpu:
    output:
        "out/gpu.txt",
    resources:
        gpu=1,
        runtime=5,
        mem_mb=200,
        cpus_per_task=1,
    shell:
        "echo cvd=${{CUDA_VISIBLE_DEVICES-unset}} > {output}"
"""


def test_snakemake_slurm_executor(slurm_cluster, tmp_path):
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    args = [
        sys.executable,
        "-m",
        "snakemake",
        *SNAKEMAKE_SLURM_ARGS,
        "-j2",
        "--directory",
        str(tmp_path),
        "--snakefile",
        str(tmp_path / "Snakefile"),
    ]
    try:
        result = run_bounded(
            args, SNAKEMAKE_TIMEOUT_S, env=slurm_cluster.env, cwd=tmp_path
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"snakemake still running after {e.timeout}s\n{e.stdout}\n{e.stderr}"
        )
    detail = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, detail
    assert (tmp_path / "out/cpu.txt").read_text().startswith("job="), detail
    (report,) = _report_values((tmp_path / "out/gpu.txt").read_text())
    assert report["cvd"] in ("0", "1"), detail


# A site configuration naming a controller that does not answer.
DECOY_CONF = """\
ClusterName=decoy
SlurmctldHost=decoy(127.0.0.1)
SlurmctldPort=9
AuthType=auth/munge
NodeName=decoy CPUs=1 State=UNKNOWN
PartitionName=decoy Nodes=decoy Default=YES State=UP
"""


@pytest.fixture
def decoy_site_config():
    """/etc/slurm/slurm.conf replaced by DECOY_CONF for one test; the machine's own
    file (or its absence) comes back afterwards, whatever the test did."""
    folder = Path("/etc/slurm")
    conf = folder / "slurm.conf"
    made_folder = not folder.exists()
    saved = conf.with_name("slurm.conf.echelon3-tests-saved")
    had_conf = conf.exists()
    folder.mkdir(exist_ok=True)
    if had_conf:
        conf.replace(saved)
    try:
        conf.write_text(DECOY_CONF)
        yield conf
    finally:
        conf.unlink(missing_ok=True)
        if had_conf:
            saved.replace(conf)
        elif made_folder:
            folder.rmdir()


def test_a_site_slurm_conf_does_not_reach_the_tests(slurm_cluster, tmp_path, decoy_site_config):
    """With a decoy /etc/slurm/slurm.conf a client without SLURM_CONF fails, and yet a
    Snakemake SLURM job (sbatch, squeue, the jobstep's own srun inside the job) runs."""
    bare = {k: v for k, v in slurm_cluster.env.items() if k != "SLURM_CONF"}
    bare["PATH"] = "/usr/bin:/bin"
    decoyed = run_bounded(["sinfo", "-h"], JOB_TIMEOUT_S, env=bare)
    assert decoyed.returncode != 0, decoyed.stdout  # the decoy is in effect
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    args = [sys.executable, "-m", "snakemake", *SNAKEMAKE_SLURM_ARGS, "-j1",
            "--directory", str(tmp_path), "--snakefile", str(tmp_path / "Snakefile"),
            "out/cpu.txt"]
    result = run_bounded(args, SNAKEMAKE_TIMEOUT_S, env=slurm_cluster.env, cwd=tmp_path)
    detail = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, detail
    assert (tmp_path / "out/cpu.txt").read_text().startswith("job="), detail
