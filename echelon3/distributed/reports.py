"""Errors from workers, said once: one traceback and one closing line for a job, not one
per rank.

Workers spawned by echelon3 share a folder (``ECHELON3_REPORTS``, made and removed by the
launcher, :func:`shared_folder`). A worker that fails writes there the line that says
why (a user error, or the config key whose code raised, :func:`echelon3.config.errors.blamed`)
and prints its traceback only if no rank printed one for the same error (same type and
message: every rank runs the same code on its shard); the launcher then says each
different line once, last. Without the folder (torchrun, ``srun``: no shared launcher)
every rank says its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

ENV = "ECHELON3_REPORTS"


def _folder() -> Path | None:
    folder = os.environ.get(ENV)
    return Path(folder) if folder else None


def shared() -> bool:
    """True in a worker whose launcher collects what the workers report."""
    folder = _folder()
    return folder is not None and folder.is_dir()


def first_to_print(signature: str) -> bool:
    """True for the first rank to claim ``signature`` (every rank without the folder)."""
    folder = _folder()
    if folder is None:
        return True
    name = "printed-" + hashlib.sha1(signature.encode()).hexdigest()[:16]
    try:
        os.close(os.open(folder / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True  # the folder is gone: better twice than never


def report(rank: str, line: str, code: int) -> bool:
    """Leave ``line`` (and the exit ``code`` it comes with) for the launcher to say; False
    when there is no launcher to say it."""
    folder = _folder()
    if folder is None:
        return False
    try:
        tmp = folder / f".line-{rank}.tmp"
        tmp.write_text(f"{code} {line}")
        tmp.replace(folder / f"line-{rank}")
        return True
    except OSError:
        return False


def lines() -> dict[int, tuple[int, str]]:
    """{rank: (exit code, line)} the workers left (in the launcher)."""
    folder = _folder()
    if folder is None or not folder.is_dir():
        return {}
    found = {}
    for path in folder.glob("line-*"):
        with contextlib.suppress(ValueError, OSError):
            code, line = path.read_text().split(" ", 1)
            found[int(path.name.removeprefix("line-"))] = (int(code), line)
    return found


@contextlib.contextmanager
def shared_folder() -> Iterator[None]:
    """In the launcher, around spawning: the folder the workers report to."""
    before = os.environ.get(ENV)
    with tempfile.TemporaryDirectory(prefix="echelon3-reports-") as folder:
        os.environ[ENV] = folder
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = before
