"""The shape of each root section, checked as soon as the config is composed.

A section of the wrong kind (a number where a mapping belongs, a list entry that
is not ``name: {module, type, config}``) is named here in one line, before any
builder trips over it. What is inside a component is the builders' business.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig

from echelon3.config.errors import ConfigError

MAPPINGS = ("net", "data", "dataloaders", "optimizer", "scheduler", "trainer", "target",
            "mlops", "evaluator", "runner")
NAMED = ("loss", "metrics")  # [{name: triple}, ...] or {name: triple, ...}
SEED_LIMIT = 2 ** 62  # room for seed + rank in torch's 64-bit seed


def _kind(node: Any) -> str:
    if isinstance(node, DictConfig | dict):
        return "a mapping"
    if isinstance(node, ListConfig | list):
        return "a list"
    return f"{type(node).__name__} {node!r}"


def _mapping(node: Any, key: str, what: str = "a mapping") -> None:
    if node is not None and not isinstance(node, DictConfig):
        raise ConfigError(key, f"must be {what}, got {_kind(node)}")


def _component(node: Any, key: str) -> None:
    """A ``module``/``type``/``config`` triple (or a section holding one) whose ``config``
    is a mapping of keyword arguments."""
    _mapping(node, key)
    if isinstance(node, DictConfig):
        _mapping(node.get("config"), f"{key}.config", "a mapping of keyword arguments")


def _named(node: Any, key: str) -> None:
    if node is None:
        return
    if isinstance(node, DictConfig):
        for name, spec in node.items():
            _component(spec, f"{key}.{name}")
        return
    if not isinstance(node, ListConfig):
        raise ConfigError(key, f"must be a list of 'name: {{module, type, config}}' entries, "
                          f"got {_kind(node)}")
    for i, item in enumerate(node):
        if not isinstance(item, DictConfig) or len(item) != 1:
            raise ConfigError(f"{key}[{i}]", "each entry must be a one-key mapping "
                              f"'name: {{module, type, config}}', got {_kind(item)}")
        for name, spec in item.items():
            _component(spec, f"{key}.{name}")


def _integer(node: Any, key: str, low: int, high: int) -> None:
    if node is None:
        return
    if not isinstance(node, int) or isinstance(node, bool) or not low <= node <= high:
        raise ConfigError(key, f"must be a whole number from {low} to {high:,}, got {node!r}")


def check_sections(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` naming the first root section of the wrong shape."""
    for key in MAPPINGS:
        _mapping(cfg.get(key), key)
    for key in NAMED:
        if not (key == "loss" and cfg.get(key) == "from_output"):  # the net's own loss
            _named(cfg.get(key), key)
    for key in ("net", "optimizer", "scheduler", "trainer", "mlops", "evaluator", "runner"):
        _component(cfg.get(key), key)
    data = cfg.get("data")
    if isinstance(data, DictConfig):
        _component(data.get("train"), "data.train")
        test = data.get("test")
        _mapping(test, "data.test")
        if isinstance(test, DictConfig) and not ("module" in test or "type" in test):
            for name, spec in test.items():
                _component(spec, f"data.test.{name}")
        elif isinstance(test, DictConfig):
            _component(test, "data.test")
    for name, loader in (cfg.get("dataloaders") or {}).items():
        _component(loader, f"dataloaders.{name}")
    _integer(cfg.get("seed"), "seed", -SEED_LIMIT, SEED_LIMIT)
