"""The warm server: torch, torchmetrics and echelon3 imported once, a fork per command.

``python -m echelon3.warm.server SOCKET OWNER SYS_PATH`` (started by
:func:`echelon3.warm.client.start_server`):

1. takes ``SOCKET``'s lock, or leaves at once (another server has it);
2. imports what a task imports, then checks that nothing started a thread or
   touched CUDA (a fork copies neither safely): if so it leaves, and every
   command keeps running in its own process;
3. listens; for each command it forks. The copy takes the command's standard
   streams, working directory, environment, ``sys.path``, umask and a session of
   its own, then runs ``echelon3.cli.main()`` as the program would, and exits
   through the interpreter's normal way out (threads joined, atexit hooks, streams
   flushed). The server sends the copy's pid, then its exit code;
4. leaves when the owner process is gone and no command is running, or after
   :data:`IDLE_S` without one, and removes its socket, lock and log.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import pkgutil
import selectors
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from echelon3.warm.client import LENGTH, PACKAGE

IDLE_S = 600.0
POLL_S = 1.0
RECEIVE_TIMEOUT_S = 10.0
PRELOAD = ("torch", "torchmetrics", "omegaconf", "yaml", "sklearn.datasets", "onnx",
           "onnxscript", "torch.onnx", "safetensors.torch")


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} [{os.getpid()}] {message}", flush=True)


def main() -> int:
    path, owner, sys_path = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    # fcntl, not filelock: the lock must stay the server's across fork, and filelock's
    # release (LOCK_UN) in a forked copy would drop it for the server too
    lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0
    sys.path[:] = sys_path
    started = time.monotonic()
    refusal = preload()
    if refusal:
        log(f"not serving: {refusal}")
        return 1
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    log(f"serving {path} for process {owner} (imports took {time.monotonic() - started:.1f} s)")
    command = serve(listener, owner, lock)
    if command is None:  # a clean stop leaves nothing behind (a failed start keeps its log)
        for leftover in (path, path.with_suffix(".log"), path.with_suffix(".lock")):
            leftover.unlink(missing_ok=True)
        return 0
    return run(*command)


def preload() -> str | None:
    """Import what the tasks import; why forking is unsafe now, or None."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # an optional dependency: its task imports it (or fails) itself
            pass
    for module in pkgutil.walk_packages([str(PACKAGE)], "echelon3."):
        if not module.name.startswith("echelon3.warm") and not module.name.endswith("__main__"):
            try:
                importlib.import_module(module.name)
            except Exception:
                pass
    import torch

    if threading.active_count() > 1:
        return "importing started threads: " + ", ".join(t.name for t in threading.enumerate())
    if torch.cuda.is_initialized():
        return "importing initialised CUDA"
    return None


def serve(listener: socket.socket, owner: int, lock: int):
    """Fork a copy per command. In the server: None once it is time to leave. In a copy:
    (its command, its connection, its standard streams), everything else closed."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    last_seen = time.monotonic()
    while True:
        for key, _ in selector.select(timeout=POLL_S):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                received = receive(conn)
                if received is None:
                    conn.close()
                    continue
                command, streams = received
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    os.close(lock)  # close, never unlock: the lock stays the server's
                    for pidfd, (_, other) in running.items():
                        os.close(pidfd)
                        other.close()
                    return command, conn, streams
                for fd in streams:
                    os.close(fd)
                log(f"process {pid}: echelon3 {' '.join(command['argv'][:1])} in {command['cwd']}")
                pidfd = os.pidfd_open(pid)
                selector.register(pidfd, selectors.EVENT_READ)
                running[pidfd] = (pid, conn)
                send(conn, {"pid": pid})
            else:
                pidfd = key.fileobj
                selector.unregister(pidfd)
                pid, conn = running.pop(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()
        now = time.monotonic()
        if running:
            last_seen = now
        elif not alive(owner) or now - last_seen > IDLE_S:
            selector.close()
            listener.close()
            return None


def receive(conn: socket.socket):
    """(the command, its three standard streams) from a client, or None (streams closed)."""
    conn.settimeout(RECEIVE_TIMEOUT_S)
    try:
        head, fds, _, _ = socket.recv_fds(conn, LENGTH.size, 3)
    except OSError:
        return None
    try:
        if len(head) == LENGTH.size and len(fds) == 3:
            body = _exactly(conn, LENGTH.unpack(head)[0])
            if body is not None:
                conn.settimeout(None)
                return json.loads(body), fds
    except (OSError, ValueError):
        pass
    for fd in fds:
        os.close(fd)
    return None


def _exactly(conn: socket.socket, length: int) -> bytes | None:
    body = b""
    while len(body) < length:
        chunk = conn.recv(length - len(body))
        if not chunk:
            return None
        body += chunk
    return body


def send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # the client is gone; its copy stopped (or stops) on its own
        pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True


def run(command: dict, conn: socket.socket, streams: list[int]) -> int:
    """In the forked copy: become the command's process, then run it."""
    os.setsid()
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
    for fd in streams:
        if fd > 2:
            os.close(fd)
    os.chdir(command["cwd"])
    os.umask(command["umask"])
    os.environ.clear()
    os.environ.update(command["env"])
    sys.path[:] = command["path"]
    sys.argv = [command["argv0"], *command["argv"]]
    sys.stdout.reconfigure(line_buffering=sys.stdout.isatty())
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    threading.Thread(target=_stop_when_gone, args=(conn,), name="echelon3-warm-client",
                     daemon=True).start()
    from echelon3 import cli

    return cli.main()


def _stop_when_gone(conn: socket.socket) -> None:
    """The client died (SIGKILL, its job cancelled): stop as a job does on SIGTERM."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
