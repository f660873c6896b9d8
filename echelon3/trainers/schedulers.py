"""``scheduler``: the learning-rate schedule, stepped per epoch or per optimizer step.

``scheduler: {module, type, config, interval}`` builds like any triple with
``optimizer=`` injected; ``interval`` is ``epoch`` (the default: stepped after
each epoch) or ``step`` (after each optimizer step, skipped windows of
``nan_policy: skip`` included, so the learning rate is a function of
``global_step``). Schedulers that take other schedulers (``SequentialLR``,
``ChainedScheduler``) list them as triples under ``config.schedulers``; each
is built on the same optimizer.

A schedule's length may be written in the run's own units: an integer argument
of the scheduler (or of a nested one) may be a string of integer arithmetic
(``+ - * //``, parentheses) over ``steps_per_epoch`` (optimizer steps in one
epoch on one rank), ``epochs`` (``trainer.config.epochs``) and ``total_steps``
(their product), e.g. ``T_max: total_steps - 500``.
"""

from __future__ import annotations

import ast
import operator
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from echelon3.errors import BuildError, ConfigError

INTERVALS = ("epoch", "step")
NAMES = ("steps_per_epoch", "epochs", "total_steps")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv}


def interval(cfg) -> str:
    """``scheduler.interval`` (``epoch`` without a scheduler)."""
    node = cfg.get("scheduler")
    value = "epoch" if node is None else node.get("interval", "epoch")
    if value not in INTERVALS:
        raise ConfigError("scheduler.interval", f"must be step or epoch, got {value!r}")
    return value


def _evaluate(text: str, lengths: Mapping[str, int], key: str) -> int:
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in lengths:
            return lengths[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError

    try:
        return int(walk(ast.parse(text, mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError):
        raise BuildError(key, f"cannot read {text!r}: write integer arithmetic (+ - * //) "
                         f"over {', '.join(NAMES)}") from None


def _lengths(node: Any, lengths: Mapping[str, int], key: str) -> Any:
    """``node`` with every string that names a length evaluated."""
    if isinstance(node, Mapping):
        return {k: _lengths(v, lengths, f"{key}.{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [_lengths(v, lengths, f"{key}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, str) and any(name in node for name in NAMES):
        return _evaluate(node, lengths, key)
    return node


def with_lengths(node: Any, steps_per_epoch: int = 1, epochs: int = 1) -> dict:
    """The ``scheduler`` section as plain data, lengths evaluated (1 step, 1 epoch
    unless given: what the pre-flight checks types with)."""
    spec = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) \
        else dict(node)
    lengths = {"steps_per_epoch": int(steps_per_epoch), "epochs": int(epochs),
               "total_steps": int(steps_per_epoch) * int(epochs)}
    if isinstance(spec.get("config"), Mapping):
        spec["config"] = _lengths(dict(spec["config"]), lengths, "scheduler.config")
    return spec


def build(cfg, optimizer, config_dir: Path | None = None, steps_per_epoch: int = 1,
          epochs: int = 1):
    """The configured scheduler on ``optimizer`` (None without a ``scheduler`` section)."""
    from echelon3.build import instantiate, is_spec

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
