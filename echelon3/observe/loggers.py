"""Loggers. Every record is a flat dict with ``split``, ``epoch`` and ``step``."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from echelon3.checkpoints.files import atomic_write_text
from echelon3.config.errors import write_error

log = logging.getLogger(__name__)


class Logger:
    """The interface: ``log`` one record, ``rewind`` to a resumed step, ``close``."""

    def log(self, record: dict) -> None:
        raise NotImplementedError

    def rewind(self, step: int) -> None:
        """Forget records after ``step`` (a resumed run logs them again)."""

    def close(self) -> None:
        pass


class NoOpLogger(Logger):
    """What every rank but 0 gets; also
    ``mlops: {module: echelon3.observe.loggers, type: NoOpLogger}``
    to log nothing at all (``path`` is accepted because the ``mlops`` builder injects it)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = path

    def log(self, record: dict) -> None:
        pass


class JsonlLogger(Logger):
    """Appends one JSON object per line to ``path`` (``history.jsonl``)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None

    def rewind(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line torn by a kill
        atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))

    def log(self, record: dict) -> None:
        try:
            if self._file is None:
                self._file = open(self.path, "a", buffering=1)
            self._file.write(json.dumps(record) + "\n")
        except OSError as e:
            self._drop()
            raise write_error(self.path, e) from e

    def _drop(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass  # the write that failed already said why

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as e:
                raise write_error(self.path, e) from e
            finally:
                self._file = None


class TensorBoardLogger(Logger):
    """Scalars to TensorBoard, tagged ``split/name``. The writer opens on the first record.

    Train records are handed to the writer in bursts, at most every ``HOLD_S`` seconds
    (and at every other record and at close): each hand-over wakes the writer's thread,
    which then competes with the training loop for the GIL. A record is one event whose
    summary holds all its scalars (what ``add_scalar`` writes, a third of its cost:
    ``add_scalar`` makes an event per value). The writer's queue holds a whole burst (its
    default, ten, made the training thread wait on the writer's thread event by event),
    and the events' checksums are computed in C (:mod:`echelon3.observe.tensorboard_crc`).
    """

    HOLD_S = 2.0
    QUEUE = 4096  # events; a burst is one per train record of the last HOLD_S seconds

    def __init__(self, log_dir: str | os.PathLike):
        from torch.utils.tensorboard import SummaryWriter  # fail here if it is missing

        from tensorboard.compat.proto.summary_pb2 import Summary

        from echelon3.observe.tensorboard_crc import install

        install()  # the records' checksums in C when google-crc32c is there
        self._writer_class, self._summary, self._value = SummaryWriter, Summary, Summary.Value
        self.log_dir = str(log_dir)
        self._writer = None
        self._purge_step: int | None = None
        self._held: list[dict] = []
        self._handed = time.monotonic()

    def rewind(self, step: int) -> None:
        # TensorBoard hides the events at or after purge_step that an earlier attempt wrote.
        self.close()
        self._purge_step = step + 1

    def log(self, record: dict) -> None:
        self._held.append(record)
        if record.get("split", "train") != "train" or \
                time.monotonic() - self._handed >= self.HOLD_S:
            self._hand_over()

    def _hand_over(self) -> None:
        try:
            if self._held and self._writer is None:
                self._writer = self._writer_class(log_dir=self.log_dir,
                                                  purge_step=self._purge_step,
                                                  max_queue=self.QUEUE)
            events = self._writer._get_file_writer() if self._held else None
            for record in self._held:
                split = record.get("split", "train")
                values = [self._value(tag=f"{split}/{name}", simple_value=value)
                          for name, value in record.items()
                          if name not in ("split", "epoch", "step") and
                          isinstance(value, int | float)]
                if values:
                    events.add_summary(self._summary(value=values), record.get("step", 0))
        except OSError as e:
            raise write_error(self.log_dir, e) from e
        finally:
            self._held = []
            self._handed = time.monotonic()

    def close(self) -> None:
        self._hand_over()
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError as e:
                raise write_error(self.log_dir, e) from e


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class DefaultLogger(Logger):
    """``history.jsonl`` in the run directory, and TensorBoard there when installed."""

    def __init__(self, path: str | os.PathLike, tensorboard: bool | None = None):
        self.loggers: list[Logger] = [JsonlLogger(Path(path) / "history.jsonl")]
        if tensorboard is None:
            tensorboard = tensorboard_available()
        if tensorboard:
            self.loggers.append(TensorBoardLogger(Path(path) / "tensorboard"))

    def log(self, record: dict) -> None:
        for logger in self.loggers:
            logger.log(record)

    def rewind(self, step: int) -> None:
        for logger in self.loggers:
            logger.rewind(step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def read_history(path: Path) -> list[dict]:
    """The records of a ``history.jsonl`` (none when it is missing; a torn line skipped)."""
    if not Path(path).is_file():
        return []
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line torn by a kill
    return records


class Relay(Logger):
    """The run's own logger first (the source of truth), then a tracker's ``log_records``.
    Train records go to the tracker in bursts, at most every ``HOLD_S`` seconds (and at
    every other record and at close): one request per burst. ``rewind`` reaches only the
    run's own logger: the tracker decides what it sends again."""

    HOLD_S = 2.0

    def __init__(self, inner: Logger, tracker):
        self.inner, self.tracker = inner, tracker
        self._held: list[dict] = []
        self._handed = time.monotonic()

    def log(self, record: dict) -> None:
        self.inner.log(record)
        self._held.append(dict(record))
        if record.get("split", "train") != "train" or \
                time.monotonic() - self._handed >= self.HOLD_S:
            self._hand_over()

    def _hand_over(self) -> None:
        held, self._held = self._held, []
        self._handed = time.monotonic()
        self.tracker.log_records(held)

    def rewind(self, step: int) -> None:
        self.inner.rewind(step)

    def close(self) -> None:
        try:
            self._hand_over()
        finally:
            self.inner.close()
