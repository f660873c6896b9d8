"""Which validation result is the best so far (``trainer.config.keep_best_on``).

Accepted forms:

- ``accuracy``                    one metric, direction from ``high_is_better``;
- ``[accuracy, f1]``              several, each must improve;
- ``{loss: {mode: directional, value: low},
     accuracy: {mode: tolerance, value: "0.1%", direction: high}}``
  a directional criterion must strictly improve; a tolerance criterion must not
  get worse than the best by more than ``value`` (absolute, or a percentage of
  the best). Several criteria combine with AND.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from echelon3.config.errors import ConfigError, did_you_mean

KEY = "trainer.config.keep_best_on"


@dataclass(frozen=True)
class Criterion:
    name: str
    high: bool
    tolerance: float | None = None  # absolute
    percent: float | None = None  # relative to the best value

    def accepts(self, new: float, best: float) -> bool:
        if self.tolerance is None and self.percent is None:
            return new > best if self.high else new < best
        slack = self.tolerance if self.tolerance is not None else abs(best) * self.percent / 100
        return new >= best - slack if self.high else new <= best + slack


def _direction(value: Any, key: str) -> bool:
    if value in ("high", "max", True):
        return True
    if value in ("low", "min", False):
        return False
    raise ConfigError(key, f"must be 'high' or 'low', got {value!r}")


def _criterion(name: str, spec: Any, high_is_better: bool) -> Criterion:
    key = f"{KEY}.{name}"
    if spec is None:
        return Criterion(name, high_is_better)
    if not isinstance(spec, Mapping):
        return Criterion(name, _direction(spec, key))
    unknown = set(spec) - {"mode", "value", "direction"}
    if unknown:
        extra = sorted(unknown)[0]
        raise ConfigError(f"{key}.{extra}", "unknown key"
                          f"{did_you_mean(extra, ['mode', 'value', 'direction'])}")
    mode = spec.get("mode", "directional")
    if mode == "directional":
        return Criterion(name, _direction(spec.get("value", "high" if high_is_better else "low"),
                                          f"{key}.value"))
    if mode != "tolerance":
        raise ConfigError(f"{key}.mode", f"must be 'directional' or 'tolerance', got {mode!r}")
    high = _direction(spec.get("direction", "high" if high_is_better else "low"),
                      f"{key}.direction")
    raw = spec.get("value")
    try:
        if isinstance(raw, str) and raw.strip().endswith("%"):
            return Criterion(name, high, percent=float(raw.strip()[:-1]))
        return Criterion(name, high, tolerance=float(raw))
    except (TypeError, ValueError):
        raise ConfigError(f"{key}.value", f"tolerance must be a number or a percentage like "
                          f"'0.1%', got {raw!r}") from None


class KeepBest:
    """Decides whether a validation result replaces the best so far."""

    def __init__(self, keep_best_on: Any, high_is_better: bool, available: Sequence[str],
                 default_set: str | None = None):
        if keep_best_on is None:
            metrics = [n for n in available if n.rsplit("/", 1)[-1] != "loss"]
            keep_best_on = {metrics[0]: None} if metrics else {
                next(n for n in available if n.rsplit("/", 1)[-1] == "loss"): "low"}
        if isinstance(keep_best_on, str):
            keep_best_on = {keep_best_on: None}
        elif isinstance(keep_best_on, Sequence):
            keep_best_on = {name: None for name in keep_best_on}
        elif not isinstance(keep_best_on, Mapping):
            raise ConfigError(KEY, "must be a metric name, a list of names or a mapping")
        self.criteria = []
        for name, spec in keep_best_on.items():
            full = name if "/" in name or default_set is None else f"{default_set}/{name}"
            if full not in available:
                raise ConfigError(KEY, f"'{name}' is not a validation metric"
                                  f"{did_you_mean(full, available)}; available: "
                                  f"{', '.join(available)}")
            self.criteria.append(_criterion(full, spec, high_is_better))

    def is_better(self, new: Mapping[str, float], best: Mapping[str, float] | None) -> bool:
        if not best:
            return True
        return all(c.accepts(new[c.name], best[c.name]) for c in self.criteria
                   if c.name in best)
