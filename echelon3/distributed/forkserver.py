"""Workers forked from a process that has torch and echelon3 imported, not spawned afresh.

A spawned worker starts a new interpreter: it imports torch and the task's modules again
(seconds, on the same cores as its siblings) and finalises that interpreter on its way out.
multiprocessing's forkserver pays the imports once, in one single-threaded process, and
each worker is a fork of it that leaves with ``os._exit``. The launcher starts it inside
its signal relay (:func:`echelon3.distributed.interrupt.relay`), so the server keeps the
relayed signals blocked for good: a SIGTERM or Ctrl-C sent to the launcher's process group
reaches the workers through the relay (each leads a session of its own:
:func:`echelon3.distributed.launch.own_session`), never the server their exit codes come
back through. The server ends when the launcher does, and its workers with it.

A worker must start as a spawned one would: with the launcher's environment, working
directory, ``sys.path``, umask and standard streams as they are at the launch. The server
keeps what it started with, so it serves a launch whose imports would read the same
environment and that has the same directory, path, umask and streams; the rest of the
environment (what the pre-flight set since) each worker takes on first (:func:`forked`).
For any other launch the server is replaced; where it cannot be (a server this module did
not start, or a Python without the hook) workers are spawned.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from typing import Callable

# What every worker imports first; the launcher adds the echelon3 modules its task uses.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.elastic.multiprocessing",
           "torchmetrics")
# What a worker's imports read from the environment (the rest it is given at its start).
# (CUDA_* and NCCL_* are read when CUDA or the process group starts, in the worker.)
IMPORT_TIME_ENV = ("PYTHON", "TORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "OPENBLAS_")
_started: tuple[list, dict] | None = None  # the running server's key and environment


def _server():
    from multiprocessing import forkserver  # here: the warm client reads this module too

    return forkserver._forkserver


def _umask() -> str | None:
    try:
        with open("/proc/self/status") as status:
            return next((line.split()[1] for line in status if line.startswith("Umask:")),
                        None)
    except OSError:
        return None


def _streams() -> list:
    found = []
    for fd in (0, 1, 2):
        try:
            info = os.fstat(fd)
        except OSError:
            found.append(None)
        else:
            found.append([info.st_dev, info.st_ino])
    return found


def launch_key() -> list:
    """What a forked worker inherits from the server that it cannot be given later: what
    the imports read from the environment, sys.path, the interpreter, cwd, umask, stdio."""
    imported_with = sorted((k, v) for k, v in os.environ.items()
                           if k.startswith(IMPORT_TIME_ENV))
    return [imported_with, list(sys.path), sys.executable, os.getcwd(), _umask(), _streams()]


def environment_since() -> tuple[dict[str, str], list[str]]:
    """The launcher's environment as it differs from the server's: (set, removed)."""
    base = _started[1] if _started else dict(os.environ)
    now = dict(os.environ)
    return ({k: v for k, v in now.items() if base.get(k) != v}, [k for k in base if k not in now])


def forked(entrypoint: Callable, since: tuple[dict[str, str], list[str]], *args) -> None:
    """A forked worker's entry point: the launcher's environment as at the launch, then
    ``entrypoint(*args)``."""
    changed, removed = since
    # Hand back the launcher's end of the pipe whose closing ends the server: held here,
    # it would keep the server (and so, through own_session's parent-death signal, this
    # worker) alive after the launcher died. (A server this worker wanted would be its own.)
    server = _server()
    if server._forkserver_alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    for name in removed:
        os.environ.pop(name, None)
    os.environ.update(changed)
    entrypoint(*args)


def preload_for(modules: list[str]) -> list[str]:
    """The modules to import in the server: torch's and echelon3's (the caller's) own,
    never the user's (an import with side effects stays in the worker, as spawned)."""
    ours = [name for name in modules if name.startswith("echelon3.")
            and not name.startswith(("echelon3.warm", "echelon3.__main__"))]
    return sorted(set(PRELOAD) | set(ours))


def start_method(modules: list[str]) -> str:
    """``"forkserver"`` with a server ready for this launch (started now, importing
    ``modules``, unless one that matches runs), or ``"spawn"``."""
    import multiprocessing

    global _started
    server = _server()
    key = launch_key()
    running = server._forkserver_pid is not None
    if running and _started is None:
        return "spawn"  # someone else's server
    if running and _started[0] != key:
        if not hasattr(server, "_stop"):
            return "spawn"
        stop()
    if _started is None:
        # at exit the workers are done; the server need not finish its imports (a launch
        # that refused before spawning) nor finalise torch while holding our stdout
        atexit.register(stop)
    if server._forkserver_pid is None or _started[0] != key:
        multiprocessing.set_forkserver_preload(preload_for(modules))
        server.ensure_running()
        _started = (key, dict(os.environ))
    else:
        pid = server._forkserver_pid
        server.ensure_running()  # restarts one that died
        if server._forkserver_pid != pid:
            _started = (key, dict(os.environ))
    return "forkserver"


def server_pid() -> int | None:
    return _server()._forkserver_pid


def stop() -> None:
    """End the running server at once. (multiprocessing's own stop waits for the server
    to see its pipe close, which a process forked from this one keeps open.)"""
    server, pid = _server(), server_pid()
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    if hasattr(server, "_stop"):
        with contextlib.suppress(OSError):  # its socket's folder may be gone at exit
            server._stop()  # reaps it and forgets it: the next start is a fresh server
    else:
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)
