"""workflow/scripts/gpu_lock.py: jobs side by side on one machine get GPUs of their own."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.workflow.helpers import GPU_LOCK, RUN_S, copy_workflow, env_with, experiment, snakemake


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
