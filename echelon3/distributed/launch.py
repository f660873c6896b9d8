"""Who launched us, spawning workers, and the process group.

Which launcher started this process is decided by :func:`detect_launcher`, in
this order: torchrun / torch elastic (``RANK`` is set), then a SLURM ``srun``
task of a multi-task step (``SLURM_PROCID`` with ``SLURM_NTASKS`` > 1), then
none. With no launcher and several devices echelon3 spawns its own workers
through ``torch.distributed.launcher.api.elastic_launch``, exactly what
torchrun does, so each worker then sees ``RANK`` and takes the first branch.

The rank helpers live in :mod:`echelon3.distributed.ranks`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator, Mapping

from echelon3.distributed import forkserver, preemption
from echelon3.distributed.ranks import _initialized, all_gather_object, get_rank

PR_SET_PDEATHSIG = 1  # prctl(2)
TIMEOUT_ENV = "ECHELON3_DDP_TIMEOUT_MIN"
DEFAULT_TIMEOUT_MIN = 30.0


@dataclass(frozen=True)
class Launcher:
    """What the environment says about this process's place in a job."""

    kind: str  # "torchrun" | "slurm" | "none"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``node[03-05,7],gpu1`` -> ``node03``."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=10, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not head:
        return nodelist
    prefix, ranges = head.group(1), head.group(3)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect_launcher(env: Mapping[str, str] | None = None) -> Launcher:
    """torchrun/elastic > SLURM srun > none. Reads only the environment."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return Launcher(
            kind="torchrun", rank=int(env["RANK"]), local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=world, local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None)
    ntasks = int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")) or 1)
    if "SLURM_PROCID" in env and ntasks > 1:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"
        job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else 15000 + job_id % 20000
        nnodes = int(env.get("SLURM_NNODES", "1") or 1)
        return Launcher(
            kind="slurm", rank=int(env["SLURM_PROCID"]), local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=ntasks, local_world_size=max(1, ntasks // nnodes),
            master_addr=env.get("MASTER_ADDR") or first_host(nodelist), master_port=port)
    return Launcher(kind="none")


# --------------------------------------------------------------------------- who runs where

_hosts: list[tuple[str, str]] = []  # (host name, address) of every rank, in rank order
# gloo: "Connection closed by peer [10.0.0.2]:4011", "Read error [10.0.0.2]:4011: Connection
# reset by peer", "Write error ... Broken pipe"
_PEER_GONE = re.compile(r"by peer|Broken pipe|Read error|Write error")
_PEER_ADDRESS = re.compile(r"\[([^\]/\s]+)\]:\d+")


def share_hosts() -> list[tuple[str, str]]:
    """Every rank's host name and address (one all-gather at start-up)."""
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = "?"
    _hosts[:] = all_gather_object((host, address))
    return list(_hosts)


def lost_peer(error: BaseException) -> str | None:
    """'rank 1 on node2 (10.0.0.2)' when a collective failed because that peer's connection
    closed (its process or node is gone); None for any other error."""
    match = _PEER_ADDRESS.search(str(error))
    if not match or not _PEER_GONE.search(str(error)):
        return None
    address = match.group(1)
    ranks = [r for r, (_, a) in enumerate(_hosts) if a == address and r != get_rank()]
    if not ranks:
        return f"the rank at {address}"
    host = _hosts[ranks[0]][0]
    names = f"rank {ranks[0]}" if len(ranks) == 1 else \
        f"one of ranks {', '.join(map(str, ranks))}"
    return f"{names} on {host} ({address})"


# --------------------------------------------------------------------------- process group

def timeout() -> timedelta:
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        minutes = float(raw) if raw else DEFAULT_TIMEOUT_MIN
    except ValueError:
        from echelon3.config.errors import ConfigError

        raise ConfigError(TIMEOUT_ENV, f"must be a number of minutes, got {raw!r}") from None
    return timedelta(minutes=minutes)


def setup_process_group(launcher: Launcher, backend: str) -> None:
    """Join the job's process group (``env://``); a no-op for a single process."""
    if launcher.world_size <= 1 or _initialized():
        return
    if launcher.kind == "slurm":
        # Translate SLURM's names into the ones torch and the rank helpers read.
        os.environ.update(RANK=str(launcher.rank), LOCAL_RANK=str(launcher.local_rank),
                          WORLD_SIZE=str(launcher.world_size),
                          LOCAL_WORLD_SIZE=str(launcher.local_world_size),
                          MASTER_ADDR=launcher.master_addr, MASTER_PORT=str(launcher.master_port))
    import torch.distributed as dist

    dist.init_process_group(backend=backend, timeout=timeout())


def teardown_process_group() -> None:
    if _initialized():
        import torch.distributed as dist

        dist.destroy_process_group()


# --------------------------------------------------------------------------- spawning

class WorkerFailed(Exception):
    """A spawned worker raised or was killed; ``exit_code`` is what the launcher returns."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


OOM_HINT = ("killed by SIGKILL, most likely the OOM-killer: lower "
            "dataloaders.*.config.num_workers / prefetch_factor (they are per rank)")


PEER_LOST = "stopped: another rank failed (its message is above)"
PEER_LOST_EXIT = 3  # a rank that stopped only because another one failed (75 is preemption's)


def peer_lost(e: BaseException) -> bool:
    """True for the error a collective raises when another rank of the job has died."""
    text = str(e)
    return type(e).__name__ == "DistNetworkError" or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer"))


def _describe_failures(err, relayed=None, said: dict[int, tuple[int, str]] | None = None,
                       nproc: int = 0) -> tuple[str, int]:
    """Turn elastic's ChildFailedError into one readable message and an exit code.

    Workers print their own traceback before exiting and leave their exit code and the
    line that says why in ``said`` (:mod:`echelon3.distributed.reports`: a user error, or
    the config key whose component raised); each different line is said once, and the
    summary names who else failed and how. ``relayed`` (an :class:`echelon3.distributed.interrupt.Relay`) tells
    which signal the launcher passed on; ``nproc`` names the ranks that left no line.
    """
    said = said or {}
    lines, codes = [], set()
    failures = sorted(err.failures.items())
    # elastic names the first worker it saw exit; the rank whose failure made that one
    # stop may exit after it, but has left its line
    others = [said[rank] for rank in sorted(said) if rank not in err.failures]
    if others:
        failures = [(r, f) for r, f in failures
                    if r in said or f.exitcode not in (1, PEER_LOST_EXIT)]
        lines = list(dict.fromkeys(line for _, line in others))
        codes = {code for code, _ in others}
    if any(f.exitcode != PEER_LOST_EXIT for _, f in failures):
        failures = [(r, f) for r, f in failures if f.exitcode != PEER_LOST_EXIT]
    for rank, failure in failures:
        code = failure.exitcode
        if code == PEER_LOST_EXIT:
            codes.add(1)
            silent = [r for r in range(nproc) if r not in said and r not in err.failures]
            first = f"rank {', '.join(map(str, silent))}" if silent else "the rank that failed"
            lines.append(f"rank {rank} (pid {failure.pid}) lost its peers; {first} stopped "
                         f"first and left no message: if it was {OOM_HINT}")
            continue
        if relayed is not None and relayed.received is not None and \
                code == -relayed.received and not relayed.killed:
            # died of the very signal passed on (it came before the worker's handler)
            codes.add(preemption.RESUBMIT_EXIT if relayed.received in preemption.signals()
                      else 130)
            continue
        if code in (130, -signal.SIGINT):
            codes.add(130)
            continue
        if code == preemption.RESUBMIT_EXIT:
            codes.add(code)
            continue
        codes.add(2 if code == 2 else 1)
        if code in (1, 2) and rank in said:
            if said[rank][1] not in lines:
                lines.append(said[rank][1])
        elif code == -signal.SIGKILL and relayed is not None and relayed.killed:
            lines.append(f"rank {rank} (pid {failure.pid}) did not stop within "
                         f"{relayed.grace_s:.0f} s of {relayed.received.name}; killed")
        elif code == -signal.SIGKILL:
            lines.append(f"rank {rank} (pid {failure.pid}): {OOM_HINT}")
        elif code < 0:
            lines.append(f"rank {rank} (pid {failure.pid}) died from signal "
                         f"{failure.signal_name()}")
        elif code != 2:
            lines.append(f"rank {rank} (pid {failure.pid}) failed with exit code {code}; "
                         "its traceback is above")
    if lines:
        return "\n".join(lines), 2 if codes == {2} else 1
    if codes == {preemption.RESUBMIT_EXIT}:
        return "preempted; the next attempt resumes", preemption.RESUBMIT_EXIT
    return ("interrupted", 130) if 130 in codes else ("a worker reported an error above", 2)


SHUTDOWN_S = 20  # a signalled worker stops at its next step; SLURM's KillWait is 30 s


def _workers() -> list[int]:
    """Pids of the workers this launcher started: spawned children, or the children of
    its forkserver (not multiprocessing's resource tracker, nor a worker's own loaders)."""
    import psutil

    found = []
    for child in psutil.Process().children():
        try:
            if child.pid == forkserver.server_pid():
                found.extend(worker.pid for worker in child.children())
            elif any("spawn_main" in part for part in child.cmdline()):
                found.append(child.pid)
        except psutil.Error:
            continue
    return found


def own_session() -> None:
    """Make this local worker the leader of a session of its own, as torch elastic makes
    torchrun's, and end it with its parent.

    With the kernel's autogroup scheduling (the Linux default), CPU time is shared
    fairly between sessions first, then between the processes of a session: a rank that
    stayed in the launching shell's session would share that session's part with
    everything else started there (a busy loop, the workflow's other jobs) and wait
    for a core while torchrun's ranks, each a session, did not. Signals reach the worker
    through the launcher's relay (:func:`spawn`), not its process group; the parent
    (the launcher, or the forkserver that ends when the launcher does) taking the
    worker with it when it dies keeps a killed launch from leaving a rank behind.
    """
    with contextlib.suppress(OSError):
        os.setsid()
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # it died before the prctl could see it
            os._exit(PEER_LOST_EXIT)


def relayed_signals() -> list[signal.Signals]:
    return [signal.Signals[name] for name in preemption.launcher_signals().split(",")]


def _start_server(modules: list[str]) -> str:
    """The start method for this launch; a forkserver is started with the relayed signals
    blocked, and keeps them blocked for good (see :mod:`echelon3.distributed.forkserver`)."""
    # Started by a later call, multiprocessing's resource tracker would unblock SIGINT and
    # SIGTERM on its way; started now, it leaves the relay's mask alone.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, relayed_signals())
    try:
        return forkserver.start_method(modules)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal meanwhile lands now


@contextlib.contextmanager
def launching(modules: list[str]) -> Iterator[None]:
    """Around a launcher's pre-flight and :func:`spawn`: the folder the workers report to
    is made, and the server they are forked from starts importing ``modules`` at once,
    beside the pre-flight (a launch that ends before spawning leaves it unused)."""
    from echelon3.distributed import reports

    with reports.shared_folder():
        _start_server(modules)
        yield


def spawn(entrypoint: Callable, args: tuple, nproc: int) -> None:
    """Run ``entrypoint(*args)`` in ``nproc`` local workers via elastic_launch (no restarts),
    forked from a server with this process's echelon3 modules imported
    (:mod:`echelon3.distributed.forkserver`), inside :func:`launching`.

    Signals (Ctrl-C, SIGTERM, the preemption warning) never raise in this process:
    they go on to the workers, which stop at a safe point and exit 130 or 75, and
    their exit codes say what happened. Workers still running ``SHUTDOWN_S`` after
    the signal are killed."""
    import torch.distributed.elastic.multiprocessing.errors as elastic_errors
    from torch.distributed.launcher.api import elastic_launch

    from echelon3.distributed import interrupt, reports

    method = _start_server([entrypoint.__module__, *sys.modules])  # the one started, if the same
    with interrupt.relay(relayed_signals(), _workers, SHUTDOWN_S) as relayed:
        try:
            if method == "forkserver":
                entrypoint, args = forkserver.forked, (
                    entrypoint, forkserver.environment_since(), *args)
            elastic_launch(_launch_config(nproc, method), entrypoint)(*args)
        except elastic_errors.ChildFailedError as e:
            failed = e
        else:
            return
        said = reports.lines()
    message, code = _describe_failures(failed, relayed, said, nproc)
    raise WorkerFailed(message, code) from None


def _launch_config(nproc: int, method: str):
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    # Workers print their own traceback or one-line error; the agent's notes and its
    # copy of the same traceback would only bury it.
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")) and \
                isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)
    return LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
        monitor_interval=0.2, start_method=method, logs_specs=DefaultLogsSpecs(),
        shutdown_timeout=SHUTDOWN_S,
        # the agent's own handlers raise wherever its main thread is; the relay above
        # does their work instead (an empty list: torch registers none)
        signals_to_handle="")
