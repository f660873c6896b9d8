"""A busy machine, and where a run's CPU goes: the CPU hog and the process-tree accounting
of ``parity.py``'s DDP rows.

:func:`hog` starts one bounded busy loop per core beside a contender (each ends by
itself after ``limit_s`` should nobody stop it). :class:`Tree` samples every process
under a command while it runs (``/proc`` through psutil): CPU seconds (user + sys),
threads, voluntary and involuntary context switches, by role: the launcher (the
process started), its workers (the ranks), the rest (multiprocessing's resource
tracker, ...). CPU seconds are robust to load where wall time is not: on a busy machine
a process waits longer, but the work it does costs the same.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import psutil

_BUSY = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def hog(enabled: bool, cores: int | None = None, limit_s: float = 900.0) -> Iterator[None]:
    """One busy loop per core (``os.cpu_count()``) for the body; nothing when not ``enabled``."""
    if not enabled:
        yield
        return
    busy = [subprocess.Popen([sys.executable, "-c", _BUSY.format(limit=limit_s)])
            for _ in range(cores or os.cpu_count() or 1)]
    try:
        yield
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.wait()


FORKSERVER = "multiprocessing.forkserver"  # the command line of echelon3's worker server


@dataclass
class Sample:
    """One process at one moment."""

    role: str
    cpu: float
    threads: int
    voluntary: int
    involuntary: int
    run_delay: float = 0.0  # seconds its threads sat runnable, waiting for a core
    session: int = 0  # its session: the group the kernel's autogroup shares CPU between


def run_delay(pid: int) -> float:
    """Seconds the threads of ``pid`` have been runnable but not running (the kernel's
    schedstat; 0 where the kernel keeps none)."""
    total = 0
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError), \
                    open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
    return total / 1e9


def _session(pid: int) -> int:
    try:
        return os.getsid(pid)
    except OSError:
        return 0


@dataclass
class Tree:
    """Samples of every process under ``root_pid``, every ``interval_s``, until :meth:`stop`."""

    root_pid: int
    worker_marks: tuple[str, ...]  # a command line with one of these is a rank
    interval_s: float = 0.2
    series: list[tuple[float, dict[int, Sample]]] = field(default_factory=list)

    def __post_init__(self):
        self._done = threading.Event()
        self._roles: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _role(self, proc: psutil.Process) -> str:
        if proc.pid not in self._roles:
            if proc.pid == self.root_pid:
                role = "launcher"
            else:
                line = " ".join(proc.cmdline())
                parent = proc.parent()
                forked = parent is not None and parent.pid != self.root_pid and \
                    FORKSERVER in " ".join(parent.cmdline())  # a rank forked from the server
                role = "worker" if forked or any(m in line for m in self.worker_marks) \
                    else "other"
            self._roles[proc.pid] = role
        return self._roles[proc.pid]

    def _snapshot(self) -> dict[int, Sample]:
        found = {}
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.root_pid)
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error), proc.oneshot():
                    t, ctx = proc.cpu_times(), proc.num_ctx_switches()
                    found[proc.pid] = Sample(self._role(proc), t.user + t.system,
                                             proc.num_threads(), ctx.voluntary, ctx.involuntary,
                                             run_delay(proc.pid), _session(proc.pid))
        return found

    def _run(self) -> None:
        while not self._done.is_set():
            snap = self._snapshot()
            if snap:
                self.series.append((time.time(), snap))
            self._done.wait(self.interval_s)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def between(self, start: float, end: float) -> dict[str, dict[str, float]]:
        """Per role, from the samples nearest ``start`` and ``end`` (epoch seconds): CPU
        seconds, seconds waiting for a core, context switches, processes, and the most
        threads any one had."""
        if not self.series:
            return {}
        first = min(self.series, key=lambda s: abs(s[0] - start))[1]
        last = min(self.series, key=lambda s: abs(s[0] - end))[1]
        out: dict[str, dict[str, float]] = {}
        sessions: dict[str, set[int]] = {}
        launcher_session = next((s.session for s in last.values() if s.role == "launcher"), 0)
        for pid, now in last.items():
            before = first.get(pid)
            row = out.setdefault(now.role, dict(cpu=0.0, voluntary=0, involuntary=0,
                                                processes=0, threads=0, run_delay=0.0,
                                                sessions=0, in_launcher_session=0))
            sessions.setdefault(now.role, set()).add(now.session)
            row["sessions"] = len(sessions[now.role])
            row["in_launcher_session"] += now.session == launcher_session
            row["processes"] += 1
            row["threads"] = max(row["threads"], now.threads)
            row["cpu"] += now.cpu - (before.cpu if before else 0.0)
            row["voluntary"] += now.voluntary - (before.voluntary if before else 0)
            row["involuntary"] += now.involuntary - (before.involuntary if before else 0)
            row["run_delay"] += now.run_delay - (before.run_delay if before else 0.0)
        return out


def children_cpu() -> float:
    """CPU seconds of every child and grandchild this process has waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_sampled(cmd: list[str], worker_marks: tuple[str, ...], **popen) -> tuple[
        subprocess.CompletedProcess, Tree, float]:
    """Run ``cmd`` to its end while sampling its tree; (result, samples, the whole tree's
    CPU seconds from the kernel's own count of waited-for children)."""
    before = children_cpu()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)
    tree = Tree(proc.pid, worker_marks)
    stdout, stderr = proc.communicate()
    tree.stop()
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    return done, tree, children_cpu() - before
