"""The ``echelon3`` program: a task handed to a warm server, or run here.

A command is handed over only where all of this holds; otherwise it runs in this
process, exactly as before:

- ``ECHELON3_WARM`` is the process id of the one who asked for it (the Snakemake
  running the workflow); the server lives while that process does;
- the command is a task (train, evaluate, ...), not ``--help`` or ``profiles``;
- no launcher started this process as one of its ranks (torchrun, srun, a SLURM
  job: their ranks, signals and accounting belong to them);
- a server for this interpreter, ``sys.path``, echelon3 source and
  import-time environment (``PYTHON*``, ``TORCH*``, ``OMP_*``, ...) is listening.
  When none is, this process starts one in the background and runs the command
  itself: nothing ever waits for a server.

Handed over, this process forwards the signals a job gets (Ctrl-C, SIGTERM,
SIGHUP, SIGQUIT, SIGUSR1/2) to the copy that runs the command, and ends with its
exit code (or its signal). Killed outright, it closes the connection, and the
copy stops as on SIGTERM.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from echelon3.distributed.forkserver import IMPORT_TIME_ENV

ENV = "ECHELON3_WARM"
# A rank of someone else's launcher, or a SLURM job: never handed over.
LAUNCHED_BY = ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
PACKAGE = Path(__file__).resolve().parents[1]
LENGTH = struct.Struct("!I")


def main() -> int:
    """The ``echelon3`` console script."""
    code = served(sys.argv[1:])
    if code is not None:
        return code
    from echelon3 import cli

    return cli.main()


def owner() -> int | None:
    """The process whose life the server shares, from ``ECHELON3_WARM`` (None: off)."""
    value = os.environ.get(ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def wanted(argv: list[str]) -> bool:
    from echelon3.cli import TASKS

    return (owner() is not None and bool(argv) and argv[0] in TASKS
            and not any(name in os.environ for name in LAUNCHED_BY))


def folder() -> Path | None:
    """This user's folder of sockets (mode 0700), or None where it is not safely ours."""
    where = Path(tempfile.gettempdir()) / f"echelon3-warm-{os.getuid()}"
    try:
        where.mkdir(mode=0o700, exist_ok=True)
        info = where.stat()
    except OSError:
        return None
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None
    return where


def fingerprint() -> list[int]:
    """echelon3's source as it is now: an edit makes a new server."""
    count = newest = size = 0
    for path in PACKAGE.rglob("*.py"):
        info = path.stat()
        count, newest, size = count + 1, max(newest, info.st_mtime_ns), size + info.st_size
    return [count, newest, size]


def socket_path(pid: int) -> Path | None:
    where = folder()
    if where is None:
        return None
    imported_with = sorted((k, v) for k, v in os.environ.items() if k.startswith(IMPORT_TIME_ENV))
    key = json.dumps([pid, sys.executable, sys.path, fingerprint(), imported_with])
    return where / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.sock"


def served(argv: list[str]) -> int | None:
    """The exit code of ``argv`` run by a warm server, or None: run it here."""
    if not wanted(argv):
        return None
    pid = owner()
    path = socket_path(pid)
    if path is None:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        start_server(path, pid)
        return None
    with conn:
        return hand_over(conn, argv)


def start_server(path: Path, pid: int) -> None:
    """A server for ``path`` in the background (it gives way if another is starting)."""
    with open(path.with_suffix(".log"), "ab") as log:
        subprocess.Popen(
            [sys.executable, "-m", "echelon3.warm.server", str(path), str(pid),
             json.dumps(sys.path)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd="/",
            start_new_session=True, close_fds=True)


def hand_over(conn: socket.socket, argv: list[str]) -> int | None:
    """Send the command, pass signals on, wait for the exit code (None: nothing ran)."""
    umask = os.umask(0)
    os.umask(umask)
    body = json.dumps({"argv": argv, "argv0": sys.argv[0], "cwd": os.getcwd(),
                       "env": dict(os.environ), "path": sys.path, "umask": umask}).encode()
    try:
        socket.send_fds(conn, [LENGTH.pack(len(body))], [0, 1, 2])
        conn.sendall(body)
    except OSError:
        return None
    replies = conn.makefile("rb")
    started = _reply(replies)
    if started is None:  # the server was stopping
        return None
    child = started["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, _frame: _forward(child, sig))
    ended = _reply(replies)
    if ended is None:
        print(f"echelon3: the warm server stopped; process {child} ran the command and its "
              "exit code is unknown", file=sys.stderr)
        return 1
    code = ended["exit"]
    if code < 0:  # the command died of a signal: so does this process, as the shell expects
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


def _forward(child: int, sig: int) -> None:
    try:
        os.kill(child, sig)
    except ProcessLookupError:
        pass


def _reply(replies) -> dict | None:
    try:
        line = replies.readline()
    except OSError:
        return None
    return json.loads(line) if line.endswith(b"\n") else None
