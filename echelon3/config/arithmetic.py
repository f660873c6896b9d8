"""The one arithmetic language of a config: integer arithmetic over named run facts.

A value may be a string such as ``total_steps - 500`` or ``(epochs - 1) * steps_per_epoch``:
integers, the names given, ``+ - * / //`` (``/`` only where it divides exactly) and
parentheses, read with Python's own parser and evaluated node by node (never ``eval``). Schedule lengths use it with the names in
:data:`LENGTHS`: ``steps_per_epoch`` (optimizer steps in one epoch on one rank),
``epochs`` (``trainer.config.epochs``), ``max_steps`` (``trainer.config.max_steps``) and
``total_steps``, the run's real total: ``epochs x steps_per_epoch``, or ``max_steps`` when
that comes first (or when ``epochs`` is null). A name the run does not have (``epochs``
of a run counted in steps only, ``steps_per_epoch`` of a stream of unknown length) is
not offered. The scheduler builder and the pre-flight both read lengths through
:func:`with_lengths`. Any other value derives from the run's facts with
``${calc:...}`` in the same language (:mod:`echelon3.config.derived`).
"""

from __future__ import annotations

import ast
import operator
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from echelon3.config.errors import BuildError, ConfigError

LENGTHS = ("steps_per_epoch", "epochs", "max_steps", "total_steps")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Div: operator.truediv}
OPERATORS = "+ - * / //"


def parse(text: str, key: str) -> ast.Expression:
    """``text`` as an expression of integers, names, ``+ - * / //`` and parentheses; a
    :class:`ConfigError` naming ``key`` if it is not one."""
    try:
        tree = ast.parse(str(text).strip(), mode="eval")
    except SyntaxError:
        raise ConfigError(key, f"cannot read {text!r}: write integer arithmetic "
                          f"({OPERATORS}, parentheses)") from None
    for node in ast.walk(tree.body):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) \
                and not isinstance(node.value, bool):
            continue
        if isinstance(node, ast.Name | ast.Load) or type(node) in _OPS \
                or isinstance(node, ast.BinOp):
            continue
        raise ConfigError(key, f"cannot read {text!r}: write integer arithmetic "
                          f"({OPERATORS}, parentheses)")
    return tree


def names_in(tree: ast.Expression) -> list[str]:
    """The names an expression uses, in order of appearance, once each."""
    return list(dict.fromkeys(n.id for n in ast.walk(tree) if isinstance(n, ast.Name)))


def compute(text: str, names: Mapping[str, int], key: str) -> int:
    """``text`` over ``names``; a :class:`ConfigError` naming ``key`` says why it has no
    integer value."""
    tree = parse(text, key)
    unknown = [n for n in names_in(tree) if n not in names]
    if unknown:
        raise ConfigError(key, f"{text!r} names {unknown[0]!r}, which this run does not have "
                          f"(it has {', '.join(names) or 'none'})")

    def walk(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return names[node.id]
        left, right = walk(node.left), walk(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv) and right == 0:
            used = ", ".join(f"{k} {names[k]}" for k in names_in(tree))
            raise ConfigError(key, f"{text!r} divides by zero for this run "
                              f"({used or 'no names'})")
        value = _OPS[type(node.op)](left, right)
        if isinstance(value, float) and not value.is_integer():
            raise ConfigError(key, f"{text!r} is not an integer for this run: "
                              f"{ast.unparse(node)} = {left} / {right} = {value:g} (use // "
                              "to round down)")
        return int(value)

    return walk(tree.body)


def evaluate(text: str, names: Mapping[str, int], key: str) -> int:
    """``text`` as integer arithmetic over ``names``; a :class:`BuildError` naming ``key``
    for anything else."""
    try:
        return compute(text, names, key)
    except ConfigError:
        raise BuildError(key, f"cannot read {text!r}: write integer arithmetic ({OPERATORS}) "
                         f"over {', '.join(names)}") from None


def substitute(node: Any, names: Mapping[str, int], key: str, low: int | None = None) -> Any:
    """``node`` with every string that mentions one of ``names`` evaluated; with ``low``,
    a value under it is a :class:`BuildError` that gives the names' values."""
    if isinstance(node, Mapping):
        return {k: substitute(v, names, f"{key}.{k}", low) for k, v in node.items()}
    if isinstance(node, list):
        return [substitute(v, names, f"{key}[{i}]", low) for i, v in enumerate(node)]
    if isinstance(node, str) and any(name in node for name in (*names, *LENGTHS)):
        value = evaluate(node, names, key)
        if low is not None and value < low:
            facts = ", ".join(f"{name} {number}" for name, number in names.items())
            raise BuildError(key, f"{node!r} is {value} for this run ({facts}); it must be at "
                             f"least {low}")
        return value
    return node


def run_lengths(steps_per_epoch: int | None, epochs: int | None,
                max_steps: int | None) -> dict[str, int]:
    """The names a length may use for this run (see the module's docstring)."""
    names = {"steps_per_epoch": steps_per_epoch, "epochs": epochs, "max_steps": max_steps}
    whole = steps_per_epoch * epochs if steps_per_epoch is not None and epochs is not None \
        else None
    total = [n for n in (whole, max_steps) if n is not None]
    names["total_steps"] = min(total) if total else None
    return {k: int(v) for k, v in names.items() if v is not None}


def with_lengths(node: Any, steps_per_epoch: int | None = None, epochs: int | None = None,
                 max_steps: int | None = None, real: bool | None = None) -> dict:
    """The ``scheduler`` section as plain data, lengths evaluated. Given the run's real
    lengths (the scheduler builder), a length under 1 is refused; without them (the
    pre-flight, which checks only types) 1 stands in for each."""
    if real is None:
        real = steps_per_epoch is not None and (epochs is not None or max_steps is not None)
    spec = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) \
        else dict(node)
    lengths = run_lengths(steps_per_epoch, epochs, max_steps) if real else \
        dict.fromkeys(LENGTHS, 1)
    if isinstance(spec.get("config"), Mapping):
        spec["config"] = substitute(dict(spec["config"]), lengths, "scheduler.config",
                                    low=1 if real else None)
    return spec
