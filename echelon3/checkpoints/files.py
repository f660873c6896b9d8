"""Checkpoints: atomic rank-0 writes, retention, safe loading, resume.

A checkpoint is data only (tensors and plain Python types), so it loads with
``torch.load(weights_only=True)`` and a file carrying pickled code is refused
without running it. Files under ``target.path``:

- ``checkpoint-<epoch>.tar``  rolling, ``epoch`` = completed epochs, newest N kept;
- ``checkpoint-<epoch>-step<step>.tar``  written part-way through epoch ``epoch + 1`` at
                              global step ``step``: on preemption, every
                              ``target.every_n_steps`` steps (the newest
                              ``step_checkpoints_to_keep`` kept), or where ``max_steps``
                              ends the run; resume takes it like any rolling checkpoint,
                              the next full one replaces it;
- ``best.tar``                the keep-best winner, a stable name for downstream rules.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import IO, Any, Callable

import torch

from echelon3.checkpoints import aside
from echelon3.checkpoints.background import BackgroundWriter
from echelon3.config.errors import CheckpointError, ConfigError, write_error
from echelon3.distributed.ranks import is_main

log = logging.getLogger(__name__)

BEST = "best.tar"
# best.tar is a hard link to this hidden twin: a workflow engine that deletes its
# declared output before rerunning a job must not destroy the best weights.
KEPT_BEST = ".best.tar"
_ROLLING = re.compile(r"^checkpoint-(\d+)(?:-step(\d+))?\.tar$")
# With trainer.config.ema: "model_state_dict" holds the average (what evaluate, export
# and finetune load) and this key the weights training goes on from.
TRAINING_WEIGHTS = "training_model_state_dict"


def training_weights(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the weights training goes on from as ``model_state_dict``."""
    return {**state, "model_state_dict": state.get(TRAINING_WEIGHTS) or state["model_state_dict"]}


def _drop_leading(key: str, prefix: str) -> str:
    while key.startswith(prefix):
        key = key[len(prefix):]
    return key


def strip_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop ``module.`` (DDP/DataParallel) and ``_orig_mod.`` (torch.compile) from keys.

    ``_orig_mod`` is torch.compile's own attribute and goes wherever it appears;
    ``module.`` goes only when every key starts with it (a wrapper), so a network
    with a child of its own called ``module`` keeps its names.
    """
    keys = list(state_dict)
    while True:
        keys = [_drop_leading(k, "_orig_mod.") for k in keys]
        if not keys or not all(k.startswith("module.") for k in keys):
            break
        keys = [k[len("module."):] for k in keys]
    while any("._orig_mod." in k for k in keys):
        keys = [k.replace("._orig_mod.", ".") for k in keys]
    return dict(zip(keys, state_dict.values()))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(file)`` on a temp file beside ``path``, fsync, rename over ``path``.

    A kill at any instant leaves either the old file or the new one, never a torn one.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise write_error(path, e) from e
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        failed = write_error(path, e) if isinstance(e, Exception) else None
        if failed is not None:
            raise failed from e
        raise


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` through :func:`atomic_write`."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint safely, or raise :class:`CheckpointError` naming the file."""
    path = Path(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(str(path), "checkpoint not found") from None
    except Exception as e:  # torn zip, foreign format, or a refused pickle global
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            reason = "refused: it carries pickled code or objects, not plain data"
        raise CheckpointError(str(path), f"cannot load checkpoint ({reason})") from e
    if not isinstance(data, dict) or "model_state_dict" not in data:
        raise CheckpointError(str(path), "not an echelon3 checkpoint (no model_state_dict)")
    data["model_state_dict"] = strip_prefixes(data["model_state_dict"])
    return data


def load_weights(net, state: dict[str, Any], source: str | os.PathLike) -> None:
    """Put a checkpoint's network weights into ``net``, or name ``source`` when they don't fit."""
    try:
        net.load_state_dict(state["model_state_dict"])
    except RuntimeError as e:
        raise CheckpointError(str(source), "does not fit the configured network: "
                              f"{' '.join(line.strip() for line in str(e).splitlines()[:2])}") from e


# --------------------------------------------------------------------------- the manager

class CheckpointManager:
    """Owns ``target.path``: rolling checkpoints, ``best.tar``, retention and resume."""

    def __init__(self, path: str | os.PathLike, checkpoints_to_keep: int = 2,
                 every_n_steps: int | None = None, every_n_minutes: float | None = None,
                 step_checkpoints_to_keep: int = 1, async_save: bool = False):
        for key, value in (("checkpoints_to_keep", checkpoints_to_keep),
                           ("step_checkpoints_to_keep", step_checkpoints_to_keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"target.{key}", f"must be an integer >= 1, got {value!r}")
        if not isinstance(async_save, bool):
            raise ConfigError("target.async_save", f"must be true or false, got {async_save!r}")
        self.path = Path(path)
        self.checkpoints_to_keep = int(checkpoints_to_keep)
        # When the trainer writes step checkpoints (echelon3.trainers.step_checkpoints).
        self.every_n_steps, self.every_n_minutes = every_n_steps, every_n_minutes
        self.step_checkpoints_to_keep = int(step_checkpoints_to_keep)
        self.async_save = async_save
        # Rank 0's writes when async_save (checkpoints/background.py).
        self.writer = BackgroundWriter()

    def settings(self) -> dict[str, Any]:
        """The constructor's arguments but ``path`` (what a manager of another kind copies)."""
        return {"checkpoints_to_keep": self.checkpoints_to_keep,
                "every_n_steps": self.every_n_steps, "every_n_minutes": self.every_n_minutes,
                "step_checkpoints_to_keep": self.step_checkpoints_to_keep,
                "async_save": self.async_save}

    def rolling(self) -> list[Path]:
        """Rolling checkpoints, newest first."""
        if not self.path.is_dir():
            return []
        found = [((int(m.group(1)), int(m.group(2) or 0)), p) for p in self.path.iterdir()
                 if (m := _ROLLING.match(p.name)) and p.is_file()]
        return [p for _, p in sorted(found, reverse=True)]

    def save_checkpoint(self, state: dict[str, Any], epoch: int, best: bool = False) -> None:
        """Write ``checkpoint-<epoch>.tar`` and apply retention; returns at once off rank 0.

        ``best``: the same state is also the keep-best winner; ``best.tar`` becomes a hard
        link to this file instead of a second write. With ``async_save`` it returns once
        the state is copied; the write, the link and retention follow in the background.
        """
        if not is_main():
            return
        path = self.path / f"checkpoint-{epoch}.tar"
        if self.async_save:
            state = self.writer.copy(state)
            self.writer.submit(lambda: self._write_checkpoint(state, path, best))
        else:
            self._write_checkpoint(state, path, best)

    def _write_checkpoint(self, state: dict[str, Any], path: Path, best: bool) -> None:
        atomic_save(state, path)
        aside.drop_passed(self.path, path)
        if best:
            self._link_best(path)
        self._retain()

    def _retain(self) -> None:
        for old in self.rolling():  # mid-epoch ones are superseded by a full epoch
            if "-step" in old.name:
                _remove(old)
        for old in self.rolling()[self.checkpoints_to_keep:]:
            _remove(old)

    def save_preempted(self, state: dict[str, Any]) -> Path:
        """Write a mid-epoch ``checkpoint-<epoch>-step<step>.tar``; returns its path (rank 0
        writes, the others only learn the name). Synchronous even with ``async_save``
        (the process exits next): it waits for the write in flight first."""
        self.wait()
        path = self.path / f"checkpoint-{state['epoch']}-step{state['global_step']}.tar"
        if is_main():
            atomic_save(state, path)
        return path

    def save_step(self, state: dict[str, Any]) -> Path:
        """A rolling mid-epoch checkpoint (named as :meth:`save_preempted`'s); then
        retention: the newest ``step_checkpoints_to_keep`` mid-epoch ones stay. With
        ``async_save`` it returns once the state is copied."""
        path = self.path / f"checkpoint-{state['epoch']}-step{state['global_step']}.tar"
        if not self.async_save:
            self.save_preempted(state)
            if is_main():
                self._retain_steps(path)
        elif is_main():
            state = self.writer.copy(state)
            self.writer.submit(lambda: self._write_step(state, path))
        return path

    def _write_step(self, state: dict[str, Any], path: Path) -> None:
        atomic_save(state, path)
        self._retain_steps(path)

    def _retain_steps(self, written: Path) -> None:
        aside.drop_passed(self.path, written)
        for old in [p for p in self.rolling() if "-step" in p.name][
                self.step_checkpoints_to_keep:]:
            _remove(old)

    def save_best(self, state: dict[str, Any]) -> None:
        """Write the keep-best winner as ``best.tar``; returns at once off rank 0."""
        if not is_main():
            return
        if self.async_save:
            state = self.writer.copy(state)
            self.writer.submit(lambda: self._write_best(state))
        else:
            self._write_best(state)

    def _write_best(self, state: dict[str, Any]) -> None:
        atomic_save(state, self.path / KEPT_BEST)
        self._publish_best()

    def wait(self, alone: bool = False) -> None:
        """Wait for the save in flight (a no-op when ``async_save`` is off) and raise what
        its write raised, the error a synchronous save would have raised.

        Every rank calls it (a subclass may finish a save together there). ``alone``: the
        run is stopping on an error; a failure of the write is logged, not raised.
        """
        try:
            self.writer.wait()
        except Exception as e:
            if not alone:
                raise
            log.error("the checkpoint written in the background failed: %s", e)

    def _link_best(self, source: Path) -> None:
        """Make ``source`` the keep-best winner without writing it again."""
        tmp = self.path / f".{BEST}.{os.getpid()}.{threading.get_ident()}.keep.link"
        try:
            tmp.unlink(missing_ok=True)
            os.link(source, tmp)
            os.replace(tmp, self.path / KEPT_BEST)
        except OSError as e:
            raise write_error(self.path / KEPT_BEST, e) from e
        self._publish_best()

    def _publish_best(self) -> None:
        tmp = self.path / f".{BEST}.{os.getpid()}.{threading.get_ident()}.link"
        try:
            tmp.unlink(missing_ok=True)
            os.link(self.path / KEPT_BEST, tmp)
            os.replace(tmp, self.path / BEST)
        except OSError as e:
            raise write_error(self.path / BEST, e) from e

    def remove_leftovers(self) -> list[Path]:
        """Delete the temp files of writers killed mid-write (``.<name>.*.tmp``, ``.best.tar.*.link``).

        Call it only while holding the run lock: then no live writer owns them.
        """
        if not is_main() or not self.path.is_dir():
            return []
        stale = [p for p in self.path.iterdir() if p.is_file() and p.name.startswith(".")
                 and (p.name.endswith(".tmp") or p.name.startswith(f".{BEST}.") and
                      p.name.endswith(".link"))]
        for path in stale:
            path.unlink(missing_ok=True)
            log.info("removed %s, left by a run that was killed while writing it", path.name)
        return stale

    def ensure_best(self) -> None:
        """Bring ``best.tar`` back if it was deleted while its twin survives."""
        if is_main() and not (self.path / BEST).exists() and (self.path / KEPT_BEST).exists():
            self._publish_best()
            os.utime(self.path / BEST)

    def latest_loadable(self) -> tuple[Path, dict[str, Any]] | None:
        """Newest rolling checkpoint that loads; bad ones are named in a warning.

        If checkpoints exist but none loads, stop rather than train over them.
        """
        candidates = self.rolling()
        errors = []
        for path in candidates:
            try:
                return path, self.load(path)
            except CheckpointError as e:
                errors.append(e)
                log.warning("skipping %s", e)
        if candidates:
            raise CheckpointError(str(errors[0].key), f"{errors[0].message}; none loads of the "
                                  f"{len(candidates)} checkpoint(s) in {self.path}: move them "
                                  "away to start over")
        return None

    def load(self, path: Path) -> dict[str, Any]:
        """One rolling checkpoint (:func:`load`; a subclass may read other layouts)."""
        return load(path)

    def for_inference(self, checkpoint: str | None = None) -> Path:
        """``checkpoint`` if given (relative to ``target.path``), else best.tar, else newest."""
        if checkpoint:
            path = Path(checkpoint)
            return path if path.is_absolute() or path.exists() else self.path / path
        if (self.path / BEST).exists():
            return self.path / BEST
        rolling = self.rolling()
        if rolling:
            return rolling[0]
        raise CheckpointError(str(self.path), "no checkpoint to load (train first)")


def _remove(path: Path) -> None:
    """A rolling checkpoint gone: a file, or a sharded checkpoint's folder."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
