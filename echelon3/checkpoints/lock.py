"""The run-folder lock: one ``echelon3 train`` per ``target.path`` at a time.

The lock is an OS file lock (``filelock``) on ``<target.path>/.echelon3.lock``,
taken without waiting: a second run on the same folder stops at once with exit
code 2, naming the holder (pid, host, start time) that the first one wrote into
``.echelon3.lock.owner``. The kernel drops the lock when its process dies, so a
lock left by a killed run is taken over without a word, and since nobody ever
waits for it, two Snakemake jobs that share a folder cannot deadlock.

Who holds it: the process the user started when echelon3 runs in-process or
spawns its own workers (the workers inherit ``ECHELON3_LOCKED`` and leave it
alone); rank 0 when a launcher (torchrun, srun) started the ranks, and rank 0
tells every rank whether it got it, so a refusal stops the whole job together.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator, Mapping

from filelock import FileLock, Timeout

from echelon3.config.errors import UserError, write_error

LOCK = ".echelon3.lock"
OWNER = ".echelon3.lock.owner"
HELD_ENV = "ECHELON3_LOCKED"  # target.path locked by the process that spawned this one


class RunLocked(UserError):
    """``target.path`` belongs to a live run."""


def _owner(folder: Path) -> str:
    try:
        info = json.loads((folder / OWNER).read_text())
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def target_path(cfg) -> str | None:
    """``target.path`` when it is set to text (the target builder reports anything else)."""
    target = cfg.get("target")
    path = target.get("path") if isinstance(target, Mapping) else None
    return path if isinstance(path, str) and path else None


@contextlib.contextmanager
def hold(folder: str | os.PathLike) -> Iterator[None]:
    """Hold the lock on ``folder`` for the duration, or raise :class:`RunLocked` at once."""
    from echelon3.checkpoints.files import atomic_write_text

    folder = Path(folder)
    lock = FileLock(str(folder / LOCK), timeout=0)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except Timeout:  # before OSError: a Timeout is one
        raise RunLocked("target.path", f"{folder} is in use by a running 'echelon3 train' "
                        f"({_owner(folder)}); wait for it to finish or choose another "
                        "target.path") from None
    except OSError as e:
        raise write_error(folder / LOCK, e) from e
    try:
        try:
            atomic_write_text(folder / OWNER, json.dumps({
                "pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
        except UserError:
            pass  # the lock holds without its note; a full disk is reported by the run's writes
        yield
    finally:
        (folder / OWNER).unlink(missing_ok=True)
        lock.release()


@contextlib.contextmanager
def for_launch(command: str, cfg) -> Iterator[None]:
    """In the process the user started: lock ``target.path`` of a ``train`` that is not one
    rank of a launcher's job; spawned workers learn through ``ECHELON3_LOCKED``."""
    from echelon3.distributed.launch import detect_launcher

    path = target_path(cfg) if command == "train" else None
    if path is None or detect_launcher().kind != "none":
        yield
        return
    with hold(path):
        os.environ[HELD_ENV] = str(Path(path).resolve())
        try:
            yield
        finally:
            os.environ.pop(HELD_ENV, None)


@contextlib.contextmanager
def for_worker(cfg) -> Iterator[None]:
    """In a training worker: rank 0 of a torchrun / srun job locks ``target.path``; every
    rank learns whether it did. Nothing to do where the launching process holds it."""
    from echelon3.distributed.launch import detect_launcher
    from echelon3.distributed.ranks import all_gather_object, get_rank

    path = target_path(cfg)
    if path is None or detect_launcher().kind == "none" or \
            os.environ.get(HELD_ENV) == str(Path(path).resolve()):
        yield
        return
    with contextlib.ExitStack() as stack:
        refusal = None
        if get_rank() == 0:
            try:
                stack.enter_context(hold(path))
            except RunLocked as e:
                refusal = e.message
        refusal = all_gather_object(refusal)[0]
        if refusal is not None:
            raise RunLocked("target.path", refusal)
        yield
