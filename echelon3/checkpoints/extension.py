"""Extending a run: ``trainer.config.epochs`` (or ``max_steps``) changed on resume while the
schedule has a length.

A resumed scheduler keeps the state it was saved with, so a cosine schedule of
``T_max: 10`` extended to 160 epochs turns cyclic, and a ``OneCycleLR`` runs past its
end. Every checkpoint records the ``epochs`` and ``max_steps`` it was trained for; when a resume asks
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
RUN_LENGTHS = re.compile(r"\b(epochs|total_steps|max_steps)\b")
MAX_STEPS_KEY = "trainer.config.max_steps"
DEFAULT_EPOCHS = 10  # the built-in Trainer's


def check_extend(value: Any) -> None:
    if value not in CHOICES:
        raise ConfigError(KEY, f"must be null or {KEEP_SCHEDULE}, got {value!r}")


def planned_epochs(cfg) -> int | None:
    """``trainer.config.epochs`` of this attempt (None: a run counted in steps only)."""
    trainer = (cfg.get("trainer") or {}).get("config") or {}
    epochs = trainer.get("epochs", DEFAULT_EPOCHS)
    return None if epochs is None else int(epochs)


def planned_max_steps(cfg) -> int | None:
    """``trainer.config.max_steps`` of this attempt (None: no step limit)."""
    trainer = (cfg.get("trainer") or {}).get("config") or {}
    steps = trainer.get("max_steps")
    return None if steps is None else int(steps)


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
    elif isinstance(node, str) and (EPOCHS_KEY in node or MAX_STEPS_KEY in node
                                     or RUN_LENGTHS.search(node)):
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
    """Refuse to resume ``state`` with another number of epochs (or ``max_steps``) when the
    schedule has a length, unless ``trainer.config.extend: keep_schedule``."""
    changed = [(key, old, new) for key, old, new in (
        (EPOCHS_KEY, state.get("epochs", "unrecorded"), planned_epochs(cfg)),
        (MAX_STEPS_KEY, state.get("max_steps", "unrecorded"), planned_max_steps(cfg)))
        if old != "unrecorded" and old != new]
    if not changed or extend == KEEP_SCHEDULE:
        return
    lengths = schedule_lengths(cfg)
    if not lengths:
        return
    key, old, new = changed[0]
    raise ConfigError(key, f"changed from {old} to {new} on resume, but "
                      f"the learning-rate schedule's length ({', '.join(lengths)}) was set for "
                      f"the old run and a resumed scheduler keeps it; start a new run from "
                      f"this one's weights (init_from, another target.path), or set {KEY}="
                      f"{KEEP_SCHEDULE} to continue on the old schedule")
