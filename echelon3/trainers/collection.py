"""Python's garbage collection at fixed optimizer steps, the same steps on every rank.

CPython collects when its allocation counters cross a threshold, a moment that differs
from rank to rank: each allocates on its own schedule. Under DDP the rank that collects
reaches the next all-reduce late, and while its peer's data waits for it, gloo's
receiving thread polls the socket without end; on a busy machine that costs the late
rank the core it needs. With ``trainer.config.gc_every_n_steps: N`` (default 50; ``0``
leaves Python's collector alone) the trainer, for the length of ``fit`` under several
processes (one process has no peer to keep waiting: its own collector stays on, which
measured a few percent faster on a launch-bound single-process run, ``benchmarks/parity.py``):

- freezes what is alive when training starts (the imports, the model, the data: a
  collection walks only what training made since, a fraction of a millisecond);
- turns the automatic collection off and, on every rank after the same steps, collects
  the young generations after every N-th optimizer step and every generation after every
  ``FULL_EVERY`` x N-th, as CPython's own thresholds do (in a process the size of a
  training run's a full collection takes a few hundred microseconds however little it
  finds, a young one a few);
- gives a forked child (a DataLoader worker) the automatic collection back;
- leaves the collector as it found it when ``fit`` returns or raises.

Nothing here is saved in a checkpoint: the steps are counted by ``global_step``, which
a resumed run restores.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Iterator

from echelon3.config.errors import ConfigError

KEY = "trainer.config.gc_every_n_steps"
FULL_EVERY = 10  # one scheduled collection in ten takes every generation
_active = [False]  # the collector is the schedule's (one per process: gc is global)


def _in_forked_child() -> None:
    if _active[0]:
        _active[0] = False
        gc.enable()


os.register_at_fork(after_in_child=_in_forked_child)


class Collection:
    """``gc_every_n_steps``: the schedule, off at ``0`` or ``null``."""

    def __init__(self, every_n_steps: int | None):
        if every_n_steps is None:
            every_n_steps = 0
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) \
                or every_n_steps < 0:
            raise ConfigError(KEY, "must be a whole number of optimizer steps >= 0 "
                              f"(0: Python's own collection), got {every_n_steps!r}")
        self.every = every_n_steps
        self.scheduled = False  # the schedule runs (inside during_fit, several processes)

    @contextlib.contextmanager
    def during_fit(self, ranks: int) -> Iterator[None]:
        """The schedule for the body, under ``ranks`` processes; nothing when off, in one
        process, or when the collector is already off (the process manages it itself)."""
        if not self.every or ranks < 2 or not gc.isenabled() or _active[0]:
            yield
            return
        gc.disable()
        gc.collect(1)  # the young garbage of the set-up, not frozen with the rest
        frozen_before = gc.get_freeze_count()
        gc.freeze()
        _active[0] = self.scheduled = True
        try:
            yield
        finally:
            _active[0] = self.scheduled = False
            if not frozen_before:  # another's freeze is kept, and ours with it
                gc.unfreeze()
            gc.enable()

    def after_step(self, global_step: int) -> None:
        if _active[0] and global_step % self.every == 0:
            gc.collect(2 if global_step % (self.every * FULL_EVERY) == 0 else 1)
