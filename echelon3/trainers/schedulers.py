"""``scheduler``: the learning-rate schedule, stepped per epoch or per optimizer step.

``scheduler: {module, type, config, interval}`` builds like any triple with
``optimizer=`` injected; ``interval`` is ``epoch`` (the default: stepped after
each epoch) or ``step`` (after each optimizer step, skipped windows of
``nan_policy: skip`` included, so the learning rate is a function of
``global_step``). Schedulers that take other schedulers (``SequentialLR``,
``ChainedScheduler``) list them as triples under ``config.schedulers``; each
is built on the same optimizer.

A schedule's length may be written in the run's own units: an integer argument
of the scheduler (or of a nested one) may be a string of integer arithmetic over
the run's lengths, e.g. ``T_max: total_steps - 500`` (:mod:`echelon3.config.arithmetic`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from echelon3.config.arithmetic import run_lengths, with_lengths
from echelon3.config.errors import BuildError, ConfigError

INTERVALS = ("epoch", "step")
# Arguments that give a schedule's length, in the unit of its interval.
LENGTH_ARGS = ("T_max", "total_iters", "total_steps")
FAR = 4  # a schedule this many times shorter or longer than the run is in the wrong unit?
log = logging.getLogger(__name__)


def interval(cfg) -> str:
    """``scheduler.interval`` (``epoch`` without a scheduler)."""
    node = cfg.get("scheduler")
    value = "epoch" if node is None else node.get("interval", "epoch")
    if value not in INTERVALS:
        raise ConfigError("scheduler.interval", f"must be step or epoch, got {value!r}")
    return value


def lengths(spec: Any, key: str = "scheduler") -> list[tuple[str, int]]:
    """(config key, value) of every schedule length in a scheduler (nested ones included;
    one per scheduler: the phases of a ``SequentialLR`` add up)."""
    if not isinstance(spec, dict):
        return []
    config = spec.get("config") or {}
    found = [(f"{key}.config.{name}", config[name]) for name in LENGTH_ARGS
             if isinstance(config.get(name), int) and not isinstance(config[name], bool)][:1]
    for i, inner in enumerate(config.get("schedulers") or []):
        found += lengths(inner, f"{key}.config.schedulers[{i}]")
    return found


def check_unit(spec: dict, unit: str, run: int) -> None:
    """Warn when the schedule's length is far from the run's (``interval: step`` with a
    length counted in epochs, or the other way round)."""
    found = lengths(spec)
    total = sum(value for _, value in found)
    if not found or run <= 0 or run / FAR <= total <= run * FAR:
        return
    keys = " + ".join(key for key, _ in found)
    log.warning("%s: the schedule lasts %d %ss but the run has %d (scheduler.interval: %s); "
                "is the length counted in %ss?", keys, total, unit, run, unit,
                "epoch" if unit == "step" else "step")


def build(cfg, optimizer, config_dir: Path | None = None, steps_per_epoch: int | None = 1,
          epochs: int | None = 1, max_steps: int | None = None):
    """The configured scheduler on ``optimizer`` (None without a ``scheduler`` section).
    ``steps_per_epoch`` None: a stream of unknown length; ``epochs`` None: a run counted in
    steps only."""
    from echelon3.config.build import instantiate, is_spec

    node = cfg.get("scheduler")
    if node is None:
        return None
    unit = interval(cfg)
    spec = with_lengths(node, steps_per_epoch, epochs, max_steps, real=True)
    run = run_lengths(steps_per_epoch, epochs, max_steps)
    check_unit(spec, unit, run.get("total_steps" if unit == "step" else "epochs", 0))
    spec.pop("interval", None)
    spec["config"] = dict(spec.get("config") or {})
    nested = spec["config"].pop("schedulers", None)
    injected: dict[str, Any] = {"optimizer": optimizer}
    if nested is not None:
        if not isinstance(nested, list) or not all(is_spec(s) for s in nested):
            raise BuildError("scheduler.config.schedulers", "must be a list of schedulers "
                             "(module, type, config), each built on the same optimizer")
        injected["schedulers"] = [
            instantiate(s, f"scheduler.config.schedulers[{i}]", config_dir, optimizer=optimizer)
            for i, s in enumerate(nested)]
    return instantiate(spec, "scheduler", config_dir, **injected)
