"""Preemption without SLURM: SIGTERM or SIGUSR1 part-way through an epoch stops every rank
at the next step, writes a mid-epoch checkpoint and exits 75; the next attempt resumes at
that step, and the final weights equal those of an uninterrupted run. One process, and two
gloo ranks under the built-in launcher."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from echelon3 import cli
from echelon3.checkpoints.files import CheckpointManager
from echelon3.distributed import preemption
from tests.conftest import echelon3_cmd, probe_config, run_cli
from tests.helpers import without_clock
from tests.test_dist import _alive, _descendants, _session_pids, _wait_for

EPOCHS, STEPS = 3, 8  # 64 samples, global batch 8
# slow steps leave time to land a signal in epoch 2; dropout makes RNG state matter
NET = {"dropout": 0.3, "sleep": 0.1}
RUN_TIMEOUT_S = 120
EXIT_LIMIT_S = 15  # SLURM's default KillWait is 30 s


def _config(directory: Path) -> Path:
    return probe_config(directory, epochs=EPOCHS, net=NET,
                        extra={"trainer": {"config": {"epochs": EPOCHS, "precision": "fp32",
                                                      "log_every_n_steps": 3,
                                                      "progress_bar": False}}})


def _args(directory: Path, world: int) -> list[str]:
    return ["train", "-cd", str(directory), "-cn", "probe", *(["nproc=2"] if world > 1 else [])]


def _history(directory: Path) -> list[dict]:
    """The run's train and validation records (losses, metrics, steps, learning rates)."""
    lines = (directory / "run" / "history.jsonl").read_text().splitlines()
    return without_clock(list(map(json.loads, lines)))  # no wall clock


def _final(directory: Path) -> dict:
    return torch.load(directory / "run" / f"checkpoint-{EPOCHS}.tar", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """world size -> (folder, final checkpoint) of an uninterrupted run."""
    runs = {}
    for world in (1, 2):
        directory = tmp_path_factory.mktemp(f"reference{world}")
        _config(directory)
        if world == 1:
            assert cli.main(_args(directory, world)) == 0
        else:
            result = run_cli(_args(directory, world), timeout=RUN_TIMEOUT_S)
            assert result.returncode == 0, result.stderr
        runs[world] = directory, _final(directory)
    return runs


def _steps_done(directory: Path) -> int:
    log = directory / "probe" / "rank0.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


def _when_in_epoch(directory: Path, epoch: int, act) -> threading.Thread:
    """Call ``act()`` from a thread once rank 0 trains its first step of ``epoch``."""
    def watch():
        end = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < end and _steps_done(directory) <= (epoch - 1) * STEPS:
            time.sleep(0.02)
        act()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _check_stopped(err: str, directory: Path, sig: signal.Signals, epoch: int) -> int:
    """The run said where it stopped and left that checkpoint; -> the global step."""
    match = re.search(rf"preempted \({sig.name}\) at epoch {epoch} step (\d+): checkpoint "
                      r"(\S+) written, ([0-9.]+) s after the signal", err)
    assert match, err
    step = int(match.group(1))
    assert (epoch - 1) * STEPS < step < epoch * STEPS, step  # part-way through the epoch
    saved = CheckpointManager(directory / "run").rolling()[0]
    assert saved.name == f"checkpoint-{epoch - 1}-step{step}.tar"
    assert str(saved) == match.group(2)
    return step


def _check_equal(directory: Path, reference) -> None:
    """Final weights, every rank's RNG state and the whole history equal the reference."""
    ref_dir, ref = reference
    final = _final(directory)
    assert final["global_step"] == EPOCHS * STEPS
    weights = final["model_state_dict"]
    assert all(torch.equal(weights[k], ref["model_state_dict"][k]) for k in weights)
    for mine, theirs in zip(final["rng_states"] or [final["rng_state"]],
                            ref["rng_states"] or [ref["rng_state"]]):
        assert torch.equal(mine["torch"], theirs["torch"])
    assert _history(directory) == _history(ref_dir)
    # a mid-epoch checkpoint is superseded by the full epoch after it
    assert not list((directory / "run").glob("checkpoint-*-step*.tar"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_one_process_stops_at_a_step_and_resumes_there(tmp_path, reference, sig, capsys,
                                                       own_handlers):
    _config(tmp_path)
    sent = []
    _when_in_epoch(tmp_path, 2, lambda: (sent.append(time.monotonic()),
                                         os.kill(os.getpid(), sig)))
    assert cli.main(_args(tmp_path, 1)) == preemption.RESUBMIT_EXIT
    elapsed = time.monotonic() - sent[0]
    assert elapsed < EXIT_LIMIT_S, f"{elapsed:.1f} s from {sig.name} to exit"
    step = _check_stopped(capsys.readouterr().err, tmp_path, sig, 2)
    preemption.reset()
    assert cli.main(_args(tmp_path, 1)) == 0
    assert f"step {step})" in capsys.readouterr().err  # "Resuming from ... (epoch 1, step N)"
    _check_equal(tmp_path, reference[1])


def _interrupted_run(directory: Path, epoch: int, sig: signal.Signals, group: bool):
    """``nproc=2`` signalled in ``epoch``: at its process group (as SLURM does) or only at
    the launching process; -> (exit code, stderr, seconds from signal to exit, pids)."""
    proc = subprocess.Popen([*echelon3_cmd(), *_args(directory, 2)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    pids, sent = set(), []

    def act():
        pids.update(_descendants(proc.pid) | set(_session_pids(proc.pid)) | {proc.pid})
        sent.append(time.monotonic())
        (os.killpg if group else os.kill)(proc.pid, sig)

    try:
        _when_in_epoch(directory, epoch, act)
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert sent, "the run ended before it was signalled"
    return proc.returncode, err, time.monotonic() - sent[0], pids


def test_two_ranks_stop_together_and_resume_exactly(tmp_path, reference):
    """SIGTERM to the whole process group in epoch 2, then SIGUSR1 to the launcher alone
    (it passes the signal on) in epoch 3; each attempt resumes where the last stopped."""
    _config(tmp_path)
    for epoch, sig, group in ((2, signal.SIGTERM, True), (3, signal.SIGUSR1, False)):
        code, err, elapsed, pids = _interrupted_run(tmp_path, epoch, sig, group)
        assert code == preemption.RESUBMIT_EXIT, err
        assert elapsed < EXIT_LIMIT_S, f"{elapsed:.1f} s from {sig.name} to exit"
        assert "Traceback" not in err and "leaked" not in err, err
        assert _wait_for(lambda: not _alive(pids), 10), f"left running: {_alive(pids)}"
        _check_stopped(err, tmp_path, sig, epoch)
    result = run_cli(_args(tmp_path, 2), timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    _check_equal(tmp_path, reference[2])
