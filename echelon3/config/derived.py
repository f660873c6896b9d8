"""Values derived in YAML: ``${calc:EXPR}``, integer arithmetic over the run's facts.

Any value of a config may be written ``"${calc:batch_size * world_size}"``. The
expression is the one language of :mod:`echelon3.config.arithmetic` (integers,
``+ - * / //``, ``/`` only where it divides exactly; parentheses go inside quotes,
``"${calc:'(epochs - 1) * steps_per_epoch'}"``, as OmegaConf's grammar asks) over the
run's facts (:data:`FACTS`); another key comes in through OmegaConf's own
interpolation, ``"${calc:${_micro_batch} * world_size}"``.

The facts and when each is known:

- ``world_size`` (processes of the run: ``nproc``, ``gpus`` or the launcher's),
  ``grad_accum_steps``, ``max_steps``, ``epochs`` (``trainer.config``) and
  ``batch_size`` (``dataloaders.train.config.batch_size``, the global batch): from the
  config and the device plan. Values over these are computed in the launching process,
  before a worker starts (:func:`derive`); the keys that define a fact may themselves be
  derived from other facts, but not in a circle.
- ``steps_per_epoch`` and ``total_steps`` (as for schedule lengths): once the train data is
  built (:func:`after_data`). Only the sections built after the data may use them
  (:data:`AFTER_DATA`).

At load, each expression is read and its names checked (:func:`check`); every mistake is
a :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from echelon3.config.arithmetic import LENGTHS, compute, names_in, parse, run_lengths
from echelon3.config.errors import ConfigError, did_you_mean

RESOLVER = "calc"
# Facts known from the config (and the device plan), with the key each is read from.
CONFIG_FACTS = {"world_size": None, "grad_accum_steps": "trainer.config.grad_accum_steps",
                "max_steps": "trainer.config.max_steps", "epochs": "trainer.config.epochs",
                "batch_size": "dataloaders.train.config.batch_size"}
DATA_FACTS = ("steps_per_epoch", "total_steps")
FACTS = (*CONFIG_FACTS, *DATA_FACTS)
# Root sections built after the train data: the only ones that may name DATA_FACTS.
AFTER_DATA = ("loss", "metrics", "optimizer", "scheduler", "trainer")

# What a ``${calc:...}`` stands as until its facts are known: the expression, other
# interpolations already put in.
_MARKER = re.compile(r"\A\$\{calc:'(?P<expr>[^']*)'\}\Z")


def _deferred(*parts: Any) -> str:
    text = ",".join(str(p) for p in parts).replace("'", '"')
    return "${" + RESOLVER + ":'" + text + "'}"


if not OmegaConf.has_resolver(RESOLVER):
    OmegaConf.register_resolver(RESOLVER, _deferred)


def _expression(value: Any) -> str | None:
    match = _MARKER.match(value) if isinstance(value, str) else None
    return match["expr"] if match else None


def _markers(node: Any, path: tuple = ()) -> Iterator[tuple[tuple, str]]:
    """(path, expression) of every ``${calc:...}`` under ``node`` (plain data)."""
    expr = _expression(node)
    if expr is not None:
        yield path, expr
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _markers(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _markers(v, (*path, i))


def dotted(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p))
                   for i, p in enumerate(path))


def _plain(cfg) -> Any:
    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg


def check(cfg) -> None:
    """Every ``${calc:...}`` of ``cfg`` reads and names only facts; a data fact only in a
    section built after the data."""
    for path, expr in _markers(_plain(cfg)):
        key = dotted(path)
        used = names_in(parse(expr, key))
        for name in used:
            if name not in FACTS:
                raise ConfigError(key, f"{expr!r} names {name!r}, not a fact of the run"
                                  f"{did_you_mean(name, FACTS)}; ${{calc:...}} knows "
                                  f"{', '.join(FACTS)}")
            if name in DATA_FACTS and path[0] not in AFTER_DATA:
                raise ConfigError(key, f"{expr!r} names {name}, which is known only once the "
                                  f"data is built, after '{path[0]}' is; only "
                                  f"{', '.join(AFTER_DATA)} may use it")


def _select(plain: dict, dotted_key: str) -> Any:
    node = plain
    for part in dotted_key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def config_facts(cfg, world_size: int) -> dict[str, int]:
    """The facts the config and the device plan give (see the module's docstring)."""
    plain = _plain(cfg)
    known: dict[str, int | None] = {"world_size": int(world_size)}

    def fact(name: str, chain: tuple[str, ...]) -> int | None:
        if name in known:
            return known[name]
        if name in DATA_FACTS:
            raise ConfigError(CONFIG_FACTS[chain[-1]], f"cannot use {name}: it is known only "
                              f"once the data is built, and {chain[-1]} is needed before")
        source = CONFIG_FACTS[name]
        if name in chain:
            circle = " -> ".join((*chain[chain.index(name):], name))
            raise ConfigError(source, f"derived values form a circle: {circle}")
        value = _select(plain, source)
        expr = _expression(value)
        if expr is not None:
            names = {n: fact(n, (*chain, name)) for n in names_in(parse(expr, source))}
            value = _compute(expr, names, source)
        if value is None and name == "grad_accum_steps":
            value = 1  # the Trainer's default
        known[name] = value if isinstance(value, int) and not isinstance(value, bool) else None
        return known[name]

    for name in CONFIG_FACTS:
        fact(name, ())
    return {k: v for k, v in known.items() if v is not None}


def _compute(expr: str, names: dict[str, int | None], key: str) -> int:
    names = {k: v for k, v in names.items() if v is not None}
    for name in names_in(parse(expr, key)):
        if name not in names and name in FACTS:
            where = CONFIG_FACTS.get(name) or "the train data (a stream of unknown length)"
            raise ConfigError(key, f"{expr!r} names {name}, which this run does not have "
                              f"({where} gives none)")
    return compute(expr, names, key)


def _put(cfg, path: tuple, value: int) -> None:
    node = cfg
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def derive(cfg: DictConfig, world_size: int) -> None:
    """Compute, in place, every ``${calc:...}`` of ``cfg`` over the config's facts; those
    naming a data fact stay for :func:`after_data`."""
    check(cfg)
    names = config_facts(cfg, world_size)
    for path, expr in _markers(_plain(cfg)):
        used = names_in(parse(expr, dotted(path)))
        if any(n in DATA_FACTS for n in used) or (path[0] == "scheduler" and any(
                n in LENGTHS for n in used)):  # a schedule's length: seen as written on resume
            continue
        _put(cfg, path, _compute(expr, names, dotted(path)))


def after_data(cfg: DictConfig, world_size: int, steps_per_epoch: int | None) -> DictConfig:
    """A copy of ``cfg`` with every ``${calc:...}`` computed, the data facts included
    (``steps_per_epoch`` None: a stream of unknown length, which offers neither)."""
    built = copy.deepcopy(cfg)
    names = config_facts(built, world_size)
    lengths = run_lengths(steps_per_epoch, names.get("epochs"), names.get("max_steps"))
    names.update({k: v for k, v in lengths.items() if k in DATA_FACTS})
    for path, expr in _markers(_plain(built)):
        _put(built, path, _compute(expr, names, dotted(path)))
    return built


def with_placeholders(node: Any) -> Any:
    """``node`` as plain data, each ``${calc:...}`` still waiting for the data replaced by 1
    (the pre-flight checks types, as it does for schedule lengths)."""
    plain = _plain(node)
    if _expression(plain) is not None:
        return 1
    if isinstance(plain, dict):
        return {k: with_placeholders(v) for k, v in plain.items()}
    if isinstance(plain, list):
        return [with_placeholders(v) for v in plain]
    return plain
