"""Runs that can be killed at any instant, and what they leave behind.

A single-process run is forked from a forkserver that has already imported torch and
echelon3 (a fresh interpreter costs seconds; the fork costs milliseconds) and calls the
CLI's entry point in a session of its own. A 2-rank run is the real command line
(``echelon3 train nproc=2`` or ``torchrun``) in a new session, marked by an environment
variable its processes inherit (torchrun puts each worker in a session of its own).
A background thread notes every process of the run as it appears, so a kill hits all of
them and a leaked ``/dev/shm`` segment can be told from another program's.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from tests.conftest import BIN, REPO, echelon3_cmd

SLOW_FSYNC = Path(__file__).with_name("slow_fsync")
DELAY = 0.25  # seconds each checkpoint write stays in flight (see slow_fsync/)
MARKER = "ECHELON3_TRIAL"
TORCHRUN = shutil.which("torchrun", path=str(BIN)) or shutil.which("torchrun")
PRELOAD = ["echelon3.cli", "echelon3.tasks.train", "echelon3.tasks.evaluate", "echelon3.nets.mlp",
           "echelon3.datasets.digits", "torchmetrics.classification", "torch.optim",
           "torch._dynamo", "sklearn.datasets", "sklearn.model_selection"]


def _forked_main(argv: list[str], log: str, env: dict[str, str]) -> None:
    """Forkserver child: its own session, the test hook, output to ``log``, then the CLI."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.update(env)
    runpy.run_path(str(SLOW_FSYNC / "sitecustomize.py"))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from echelon3 import cli

    sys.exit(cli.main(argv))


def forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Run:
    """One ``echelon3 train`` of a trial: ``mode`` is single, builtin or torchrun."""

    def __init__(self, mode: str, config_dir: Path, log: Path, ctx=None):
        self.mode, self.log = mode, log
        self.marker = f"{MARKER}={uuid.uuid4().hex}".encode()
        env = {"ECHELON3_TEST_SLOW_FSYNC": str(DELAY), "PYTHONUNBUFFERED": "1"}
        args = ["train", "-cd", str(config_dir), "-cn", "run"]
        self.started = time.monotonic()
        if mode == "single":
            self.proc = ctx.Process(target=_forked_main, args=(args, str(log), env))
            self.proc.start()
        else:
            env = {**os.environ, **env, MARKER: self.marker.split(b"=")[1].decode(),
                   "PYTHONPATH": os.pathsep.join([str(SLOW_FSYNC), str(REPO)])}
            env.pop("RANK", None)
            cmd = [*echelon3_cmd(), *args, "nproc=2"] if mode == "builtin" else \
                [TORCHRUN, "--standalone", "--nproc_per_node=2", echelon3_cmd()[0], *args]
            self.proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"),
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self.seen: set[int] = {self.pid}
        self._not_ours: set[int] = set()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------ processes

    def processes(self) -> set[int]:
        """Live processes of this run: its session, or (torchrun workers) its marker."""
        found = set()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid in self._not_ours:
                continue
            if _sid(pid) == self.pid or pid in self.seen or \
                    (self.mode != "single" and self.marker in _environ(pid)):
                if alive(pid):
                    found.add(pid)
            elif self.mode == "single" or _environ(pid):
                self._not_ours.add(pid)
        return found

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.seen |= self.processes()
            self._stop.wait(0.05)

    # ------------------------------------------------------------------ life

    def returncode(self) -> int | None:
        return self.proc.exitcode if self.mode == "single" else self.proc.poll()

    def running(self) -> bool:
        return self.returncode() is None

    def wait(self, timeout: float) -> int:
        if self.mode == "single":
            self.proc.join(timeout)
        else:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        code = self.returncode()
        if code is None:
            self.kill()
            raise AssertionError(f"{self.mode} run still going after {timeout} s:\n"
                                 f"{self.output()}")
        self._stop.set()
        self._watcher.join()
        return code

    def kill(self) -> float:
        """SIGKILL every process group of the run at once; returns the run's age."""
        age = time.monotonic() - self.started
        pids = self.processes() | {self.pid}
        # again while any is found: torchrun's agent may have started a worker (in a
        # process group of its own) between the look and the kill
        for _ in range(50):
            live = {p for p in pids if alive(p)}
            if not live:
                break
            for group in {_group(p) for p in live} - {None, os.getpgid(0)}:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
            for pid in live:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
            pids = self.processes()
        self.wait(30)
        return age

    def survivors(self, grace: float = 10.0) -> list[int]:
        """Processes of this run still alive ``grace`` seconds from now at the latest."""
        end = time.monotonic() + grace
        while time.monotonic() < end:
            left = [p for p in self.seen | self.processes() if alive(p) and p != os.getpid()]
            if not left:
                return []
            time.sleep(0.1)
        return left

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def leaked_shm(before: set[str], pids: set[int]) -> list[str]:
    """Segments created since ``before`` whose name carries a pid of the run (torch names
    its segments ``torch_<pid>_...``); other programs' segments are none of our business."""
    marks = {f"_{pid}_" for pid in pids} | {f"_{pid}" for pid in pids}
    return sorted(name for name in shm_names() - before
                  if any(name.endswith(m) or m + "_" in name + "_" for m in marks))
