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

from pathlib import Path
from typing import Any

from echelon3.config.arithmetic import with_lengths
from echelon3.config.errors import BuildError, ConfigError

INTERVALS = ("epoch", "step")


def interval(cfg) -> str:
    """``scheduler.interval`` (``epoch`` without a scheduler)."""
    node = cfg.get("scheduler")
    value = "epoch" if node is None else node.get("interval", "epoch")
    if value not in INTERVALS:
        raise ConfigError("scheduler.interval", f"must be step or epoch, got {value!r}")
    return value


def build(cfg, optimizer, config_dir: Path | None = None, steps_per_epoch: int = 1,
          epochs: int = 1):
    """The configured scheduler on ``optimizer`` (None without a ``scheduler`` section)."""
    from echelon3.config.build import instantiate, is_spec

    node = cfg.get("scheduler")
    if node is None:
        return None
    interval(cfg)
    spec = with_lengths(node, steps_per_epoch, epochs)
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
