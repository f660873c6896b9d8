"""Off the happy path under plain `snakemake -j1`: Ctrl-C and a hard kill during
training, each followed by a plain rerun that continues from the checkpoint, a
signal to the Snakemake process alone, and a failed job whose echelon3 error
reaches the console."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.workflow.helpers import (DRY_S, RUN_S, checkpoint_epochs, cmdline, copy_workflow,
                                    descendants, env_with, experiment, failing, resumed_epoch,
                                    snakemake, wait_for)

EPOCHS = 30


def start(wf):
    """Plain `snakemake -j1` in a process group of its own, as a terminal runs it."""
    return subprocess.Popen([sys.executable, "-m", "snakemake", "-j1"], cwd=wf, env=env_with(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def stop(proc, sig):
    """Send `sig` to the whole group (Ctrl-C reaches every process of a terminal's job)."""
    try:
        os.killpg(proc.pid, sig)
        return proc.communicate(timeout=DRY_S)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_ctrl_c_and_a_hard_kill_then_a_plain_rerun_finishes_from_the_checkpoint(tmp_path):
    wf = copy_workflow(tmp_path, {"experiments": {
        "mlp": experiment("digits_mlp", f"trainer.config.epochs={EPOCHS}")}})
    folder, log = wf / "results/mlp", wf / "logs/train/mlp.log"

    # 1. Ctrl-C while training: echelon3 and Snakemake stop; the output stays incomplete
    first = start(wf)
    wait_for(lambda: checkpoint_epochs(folder), RUN_S, "a first checkpoint", first)
    assert any("echelon3 train" in cmdline(p) for p in descendants(first.pid))
    out = stop(first, signal.SIGINT)
    assert first.returncode != 0, out
    kept = checkpoint_epochs(folder)
    assert kept and max(kept) < EPOCHS, kept
    assert not (folder / "summary.json").exists()  # a partly trained run is not finished

    # 2. plain `snakemake -j1` reruns the incomplete job, which resumes; then a hard
    #    kill of Snakemake and everything below it (no clean-up at all)
    second = start(wf)
    wait_for(lambda: max(checkpoint_epochs(folder) or [0]) > max(kept), RUN_S,
             "a checkpoint after the resume", second)
    stop(second, signal.SIGKILL)
    assert resumed_epoch(log) == max(kept)
    kept_again = checkpoint_epochs(folder)
    assert max(kept_again) < EPOCHS, "training ended before the kill"

    # 3. the kill left the folder locked: unlock, and plain `snakemake -j1` finishes
    snakemake(wf, "--unlock")
    snakemake(wf, "-j1", timeout=RUN_S)
    assert resumed_epoch(log) >= max(kept_again)
    assert checkpoint_epochs(folder)[-1] == EPOCHS
    assert json.loads((folder / "summary.json").read_text())["epochs"] == EPOCHS
    history = (folder / "history.jsonl").read_text().splitlines()
    assert {json.loads(line)["epoch"] for line in history if line.strip()} == \
        set(range(1, EPOCHS + 1))
    assert (folder / "metrics.json").is_file()
    assert "Nothing to be done" in snakemake(wf, "-n")


def test_a_signal_to_snakemake_alone_stops_training_at_once(tmp_path):
    """`kill -INT <snakemake>` and then `kill -TERM <snakemake>` from another shell: each
    time training stops within seconds (130, then a checkpoint and 75), Snakemake exits
    non-zero and no process is left; the second run resumed from the first."""
    wf = copy_workflow(tmp_path, {"experiments": {
        "mlp": experiment("digits_mlp", f"trainer.config.epochs={EPOCHS}")}})
    folder, log = wf / "results/mlp", wf / "logs/train/mlp.log"
    for sig, says in ((signal.SIGINT, "echelon3: interrupted"),
                      (signal.SIGTERM, "preempted (SIGTERM)")):
        run = start(wf)
        try:
            before = max(checkpoint_epochs(folder) or [0])
            wait_for(lambda: max(checkpoint_epochs(folder) or [0]) > before, RUN_S,
                     "a checkpoint", run)
            below = descendants(run.pid)
            os.kill(run.pid, sig)  # Snakemake only, not its process group
            sent = time.monotonic()
            try:
                out = run.communicate(timeout=DRY_S)[0]
            except subprocess.TimeoutExpired as e:  # say where the job stood
                left = [cmdline(p) for p in below if cmdline(p)]
                tail = log.read_text()[-3000:] if log.is_file() else "(no job log)"
                raise AssertionError(f"{sig.name}: Snakemake still running after {DRY_S} s; "
                                     f"left: {left}\njob log:\n{tail}") from e
            took = time.monotonic() - sent
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
        assert run.returncode != 0, out
        assert took < 30, f"{sig.name}: Snakemake took {took:.0f} s to stop"
        assert says in log.read_text(), log.read_text()[-3000:]
        assert max(checkpoint_epochs(folder)) < EPOCHS, "training ran to its end"
        assert not [pid for pid in below if cmdline(pid)], [cmdline(p) for p in below]
    assert resumed_epoch(log) > 0
    assert not (folder / "summary.json").exists()


def test_a_failed_job_shows_echelon3_error_line_on_the_console(tmp_path):
    wf = copy_workflow(tmp_path, {"experiments": {
        "typo": experiment("digits_mlp", "trainer.config.epocs=2")}})
    console = failing(wf, "-j1", timeout=RUN_S).stdout
    assert ("echelon3: error: trainer.config.epocs: Trainer does not accept 'epocs' "
            "(did you mean 'epochs'?)") in console, console
    assert not (wf / "results/typo/config.yaml").exists()
