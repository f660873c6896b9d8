"""Early stopping on the keep-best metric: ``trainer.config.early_stopping``.

``{patience, min_delta: 0}``. Looked at after each epoch's validation, on the
first metric of ``keep_best_on`` and in its direction: an epoch improves when
its value beats the best so far by more than ``min_delta``. After ``patience``
epochs in a row without improvement the run stops, as a finished run: its
epoch checkpoint records the stop, ``summary.json`` says when and why, the
workflow takes its outputs as final, and resuming it trains no more.
Mid-epoch validations (``times_to_validate_per_epoch``) choose ``best.tar``
but do not count here. With ``val_check_interval`` (a run validated every N steps) every
validation counts, and ``patience`` is a number of validations.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from echelon3.config.errors import ConfigError

KEY = "trainer.config.early_stopping"
SETTINGS = ("patience", "min_delta")


class EarlyStopping:
    def __init__(self, config: Mapping[str, Any], metric: str, high: bool, unit: str = "epoch"):
        if not isinstance(config, Mapping):
            raise ConfigError(KEY, "must be a mapping {patience, min_delta}")
        for name in config:
            if name not in SETTINGS:
                raise ConfigError(f"{KEY}.{name}", "unknown key; early_stopping takes "
                                  "patience, min_delta")
        patience, delta = config.get("patience"), config.get("min_delta", 0)
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ConfigError(f"{KEY}.patience", f"must be an integer >= 1, got {patience!r}")
        if not isinstance(delta, int | float) or delta < 0:
            raise ConfigError(f"{KEY}.min_delta", f"must be a number >= 0, got {delta!r}")
        self.patience, self.min_delta = patience, float(delta)
        self.metric, self.high, self.unit = metric, high, unit
        self.best: float | None = None
        self.best_epoch = 0
        self.waited = 0
        self.stopped_epoch: int | None = None

    def improves(self, value: float) -> bool:
        if self.best is None or math.isnan(self.best):
            return not math.isnan(value)
        return (value - self.best > self.min_delta) if self.high \
            else (self.best - value > self.min_delta)

    def update(self, epoch: int, metrics: Mapping[str, float]) -> bool:
        """After the validation of epoch ``epoch`` (of step ``epoch`` when ``unit`` is step);
        True when the run stops here."""
        value = float(metrics[self.metric])
        if self.improves(value):
            self.best, self.best_epoch, self.waited = value, epoch, 0
        else:
            self.waited += 1
        if self.waited >= self.patience:
            self.stopped_epoch = epoch
        return self.stopped_epoch is not None

    def reason(self) -> str | None:
        if self.stopped_epoch is None:
            return None
        counted = "epoch(s)" if self.unit == "epoch" else "validation(s)"
        return (f"stopped early after {self.unit} {self.stopped_epoch}: {self.metric} did not "
                f"improve by more than {self.min_delta:g} for {self.patience} {counted} "
                f"(best {self.best:.6g} at {self.unit} {self.best_epoch})")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "waited": self.waited,
                "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.best_epoch = state["best"], int(state["best_epoch"])
        self.waited, self.stopped_epoch = int(state["waited"]), state["stopped_epoch"]
