"""Warm start (echelon3.warm): a served command does what the program does by itself,
signals reach it, a killed client stops it, and the server leaves with its owner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from echelon3.warm import client
from tests.conftest import echelon3_cmd, probe_config, run_cli


def _wait(condition, what: str, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return found


def _served_pids(folder: Path) -> list[int]:
    return [int(line.split("process ")[1].split(":")[0])
            for log in folder.glob("*.log") for line in log.read_text().splitlines()
            if "] process " in line]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """(env with ECHELON3_WARM and a TMPDIR of its own, the socket folder, the owner)."""
    tmp = tmp_path_factory.mktemp("warm")
    owner = subprocess.Popen(["sleep", "600"])
    env = {"ECHELON3_WARM": str(owner.pid), "TMPDIR": str(tmp)}
    yield env, tmp / f"echelon3-warm-{os.getuid()}", owner
    owner.kill()
    owner.wait()


def test_a_served_command_matches_the_program_then_the_server_leaves_with_its_owner(
        tmp_path, warm):
    env, folder, owner = warm
    probe_config(tmp_path, epochs=1)
    common = ["-cd", str(tmp_path), "-cn", "probe"]
    assert run_cli(["train", *common]).returncode == 0
    direct = run_cli(["evaluate", *common, f"evaluator.config.output={tmp_path}/direct.json"])
    assert direct.returncode == 0, direct.stderr
    # the first command runs by itself and starts the server
    first = run_cli(["evaluate", *common, f"evaluator.config.output={tmp_path}/first.json"],
                    env=env)
    assert first.returncode == 0, first.stderr
    sock = _wait(lambda: next(folder.glob("*.sock"), None), "a server listening")
    assert _served_pids(folder) == []
    served = run_cli(["evaluate", *common, f"evaluator.config.output={tmp_path}/served.json"],
                     env=env)
    assert served.returncode == 0, served.stderr
    assert len(_served_pids(folder)) == 1
    scores = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("direct", "served")]
    assert scores[0] == scores[1]
    assert served.stdout.replace("served", "direct") == direct.stdout
    # a user error: the same one line and exit code 2, from the served copy
    typo = run_cli(["evaluate", "-cd", str(tmp_path), "-cn", "prob"], env=env)
    alone = run_cli(["evaluate", "-cd", str(tmp_path), "-cn", "prob"])
    assert "did you mean" in alone.stderr
    assert (typo.returncode, typo.stderr) == (alone.returncode, alone.stderr) == (2, alone.stderr)
    assert len(_served_pids(folder)) == 2
    # no task, or a rank of a launcher: never handed over
    assert run_cli(["--version"], env=env).returncode == 0
    assert run_cli(["evaluate", *common, f"evaluator.config.output={tmp_path}/x.json"],
                   env={**env, "SLURM_JOB_ID": "7"}).returncode == 0
    assert len(_served_pids(folder)) == 2
    owner.kill()
    owner.wait()
    _wait(lambda: not sock.exists() and not list(folder.glob("*.log")), "the server gone", 30)


def test_signals_reach_the_served_command_and_a_killed_client_stops_it(tmp_path, warm):
    env, folder, _ = warm
    owner = subprocess.Popen(["sleep", "600"])  # the test before ended the first one
    env = {**env, "ECHELON3_WARM": str(owner.pid)}
    probe_config(tmp_path, train_size=4000, batch=1, epochs=50)
    steps = tmp_path / "probe" / "rank0.jsonl"
    cmd = [*echelon3_cmd(), "train", "-cd", str(tmp_path), "-cn", "probe"]
    proc = None
    try:
        refused = run_cli(["evaluate", "-cd", str(tmp_path), "-cn", "probe"], env=env)
        assert refused.returncode == 2  # no checkpoint yet; it started the server
        _wait(lambda: next(folder.glob("*.sock"), None), "a server listening")
        seen: set[int] = set()
        for stop, code in ((signal.SIGINT, 130), (signal.SIGKILL, -signal.SIGKILL)):
            steps.unlink(missing_ok=True)
            proc = subprocess.Popen(cmd, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            (pid,) = _wait(lambda: set(_served_pids(folder)) - seen, "handed over")
            seen.add(pid)
            _wait(lambda: steps.exists() and steps.stat().st_size > 0, "training")
            proc.send_signal(stop)
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == code, err
            if stop == signal.SIGINT:
                assert "echelon3: interrupted" in err and "Traceback" not in err, err
            _wait(lambda: not _alive(pid), "the served copy stopped", 120)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        owner.kill()
        owner.wait()


def test_only_a_task_outside_a_launcher_is_handed_over(monkeypatch):
    for name in (client.ENV, *client.LAUNCHED_BY):
        monkeypatch.delenv(name, raising=False)
    assert not client.wanted(["train"])
    monkeypatch.setenv(client.ENV, "not a pid")
    assert not client.wanted(["train"])
    monkeypatch.setenv(client.ENV, str(os.getpid()))
    assert client.wanted(["train"]) and client.wanted(["evaluate", "-cn", "x"])
    assert not client.wanted([]) and not client.wanted(["--help"])
    assert not client.wanted(["profiles", "install"])
    for name in client.LAUNCHED_BY:
        monkeypatch.setenv(name, "0")
        assert not client.wanted(["train"]), name
        monkeypatch.delenv(name)


def test_the_server_is_keyed_by_the_source_and_the_import_time_environment(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first = client.socket_path(1)
    assert client.socket_path(1) == first and client.socket_path(2) != first
    with monkeypatch.context() as changed:
        changed.setenv("OMP_NUM_THREADS", str(int(os.environ.get("OMP_NUM_THREADS", "0")) + 7))
        assert client.socket_path(1) != first
    with monkeypatch.context() as changed:
        changed.setenv("CUDA_VISIBLE_DEVICES", "3")  # read when CUDA starts, in the copy
        assert client.socket_path(1) == first
    source = next(client.PACKAGE.rglob("*.py"))
    info = source.stat()
    newest = max(path.stat().st_mtime_ns for path in client.PACKAGE.rglob("*.py"))
    os.utime(source, ns=(info.st_atime_ns, newest + 1_000_000_000))
    try:
        assert client.socket_path(1) != first
    finally:
        os.utime(source, ns=(info.st_atime_ns, info.st_mtime_ns))
