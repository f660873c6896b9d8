"""The one arithmetic language of a config: integer arithmetic over named run facts.

A value may be a string such as ``total_steps - 500`` or ``(epochs - 1) * steps_per_epoch``:
integers, the names given, ``+ - * //`` and parentheses, read with Python's own parser and
evaluated node by node (never ``eval``). Schedule lengths use it with the names in
:data:`LENGTHS`: ``steps_per_epoch`` (optimizer steps in one epoch on one rank),
``epochs`` (``trainer.config.epochs``) and ``total_steps`` (their product). The
scheduler builder and the pre-flight both read lengths through :func:`with_lengths`.
"""

from __future__ import annotations

import ast
import operator
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from echelon3.config.errors import BuildError

LENGTHS = ("steps_per_epoch", "epochs", "total_steps")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv}


def evaluate(text: str, names: Mapping[str, int], key: str) -> int:
    """``text`` as integer arithmetic over ``names``; a :class:`BuildError` naming ``key``
    for anything else."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError

    try:
        return int(walk(ast.parse(text, mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError):
        raise BuildError(key, f"cannot read {text!r}: write integer arithmetic (+ - * //) "
                         f"over {', '.join(names)}") from None


def substitute(node: Any, names: Mapping[str, int], key: str, low: int | None = None) -> Any:
    """``node`` with every string that mentions one of ``names`` evaluated; with ``low``,
    a value under it is a :class:`BuildError` that gives the names' values."""
    if isinstance(node, Mapping):
        return {k: substitute(v, names, f"{key}.{k}", low) for k, v in node.items()}
    if isinstance(node, list):
        return [substitute(v, names, f"{key}[{i}]", low) for i, v in enumerate(node)]
    if isinstance(node, str) and any(name in node for name in names):
        value = evaluate(node, names, key)
        if low is not None and value < low:
            facts = ", ".join(f"{name} {number}" for name, number in names.items())
            raise BuildError(key, f"{node!r} is {value} for this run ({facts}); it must be at "
                             f"least {low}")
        return value
    return node


def with_lengths(node: Any, steps_per_epoch: int | None = None, epochs: int | None = None) -> dict:
    """The ``scheduler`` section as plain data, lengths evaluated. Given the run's real
    ``steps_per_epoch`` and ``epochs`` (the scheduler builder), a length under 1 is refused;
    without them (the pre-flight, which checks only types) 1 step and 1 epoch stand in."""
    real = steps_per_epoch is not None and epochs is not None
    steps_per_epoch, epochs = steps_per_epoch or 1, epochs or 1
    spec = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) \
        else dict(node)
    lengths = {"steps_per_epoch": int(steps_per_epoch), "epochs": int(epochs),
               "total_steps": int(steps_per_epoch) * int(epochs)}
    if isinstance(spec.get("config"), Mapping):
        spec["config"] = substitute(dict(spec["config"]), lengths, "scheduler.config",
                                    low=1 if real else None)
    return spec
