"""Extending a run: ``trainer.config.epochs`` changed on resume while the schedule has a length.

A resumed scheduler keeps the state it was saved with, so a cosine schedule of
``T_max: 10`` extended to 160 epochs turns cyclic, and a ``OneCycleLR`` runs past its
end. Every checkpoint records the ``epochs`` it was trained for; when a resume asks
for another number and the scheduler has a length (an argument named in
``LENGTH_ARGUMENTS``, anywhere in ``scheduler``, or any value interpolated from
``trainer.config.epochs``), the run stops with one line naming the two ways on: a new
run started from this one's weights (``init_from``), or
``trainer.config.extend: keep_schedule``, which continues on the old schedule.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from omegaconf import OmegaConf

from echelon3.config.errors import ConfigError

KEY = "trainer.config.extend"
KEEP_SCHEDULE = "keep_schedule"
CHOICES = (None, KEEP_SCHEDULE)
# Scheduler arguments that fix how many epochs (or steps) the schedule lasts.
LENGTH_ARGUMENTS = ("T_max", "total_steps", "total_iters", "epochs")
EPOCHS_KEY = "trainer.config.epochs"
# The run's own lengths a scheduler argument may name (echelon3.trainers.schedulers).
RUN_LENGTHS = re.compile(r"\b(epochs|total_steps)\b")
DEFAULT_EPOCHS = 10  # the built-in Trainer's


def check_extend(value: Any) -> None:
    if value not in CHOICES:
        raise ConfigError(KEY, f"must be null or {KEEP_SCHEDULE}, got {value!r}")


def planned_epochs(cfg) -> int:
    """``trainer.config.epochs`` of this attempt."""
    trainer = (cfg.get("trainer") or {}).get("config") or {}
    return int(trainer.get("epochs", DEFAULT_EPOCHS))


def _length_settings(node: Any, key: str):
    """Config paths under ``node`` (unresolved) that set a schedule's length."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            if k in LENGTH_ARGUMENTS and not isinstance(v, Mapping | list):
                yield f"{key}.{k}"
            else:
                yield from _length_settings(v, f"{key}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _length_settings(v, f"{key}[{i}]")
    elif isinstance(node, str) and (EPOCHS_KEY in node or RUN_LENGTHS.search(node)):
        yield f"{key} ({node})"


def schedule_lengths(cfg) -> list[str]:
    """Where the configured scheduler takes its length from (empty: it has none)."""
    scheduler = cfg.get("scheduler")
    if scheduler is None:
        return []
    plain = OmegaConf.to_container(scheduler, resolve=False) \
        if OmegaConf.is_config(scheduler) else scheduler
    return list(dict.fromkeys(_length_settings(plain, "scheduler")))


def check_extension(cfg, state: Mapping[str, Any], extend: Any) -> None:
    """Refuse to resume ``state`` with another number of epochs when the schedule has a
    length, unless ``trainer.config.extend: keep_schedule``."""
    recorded = state.get("epochs")
    epochs = planned_epochs(cfg)
    if recorded is None or int(recorded) == epochs or extend == KEEP_SCHEDULE:
        return
    lengths = schedule_lengths(cfg)
    if not lengths:
        return
    raise ConfigError(EPOCHS_KEY, f"changed from {int(recorded)} to {epochs} on resume, but "
                      f"the learning-rate schedule's length ({', '.join(lengths)}) was set for "
                      f"the old run and a resumed scheduler keeps it; start a new run from "
                      f"this one's weights (init_from, another target.path), or set {KEY}="
                      f"{KEEP_SCHEDULE} to continue on the old schedule")
