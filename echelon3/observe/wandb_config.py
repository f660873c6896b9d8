"""The ``wandb`` root key, checked before any process starts, and its defaults.

See :mod:`echelon3.observe.wandb` for what is tracked."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from echelon3.config.errors import ConfigError, did_you_mean
from echelon3.observe.mlflow_run import EXPERIMENT_ENV, SWEEP_ENV

KEYS = ("project", "entity", "mode", "run_name", "group", "dir")
MODES = ("online", "offline")


@dataclass(frozen=True)
class Settings:
    project: str
    entity: str | None
    mode: str
    run_name: str
    group: str | None
    dir: str  # where wandb writes its own files (its ``wandb/`` folder goes inside)


def _given(node) -> dict | None:
    """The ``wandb`` key as a dict, or None when tracking is off."""
    if node is None or node is False:
        return None
    if node is True:
        return {}
    if not isinstance(node, DictConfig | dict):
        raise ConfigError("wandb", f"must be true, false or a mapping with keys "
                          f"{', '.join(KEYS)}; got {node!r}")
    given = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) \
        else dict(node)
    for key, value in given.items():
        if key not in KEYS:
            raise ConfigError(f"wandb.{key}", f"unknown key{did_you_mean(str(key), KEYS)}; "
                              f"known: {', '.join(KEYS)}")
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"wandb.{key}", f"must be a non-empty string, got {value!r}")
    if given.get("mode") is not None and given["mode"] not in MODES:
        raise ConfigError("wandb.mode", f"must be online or offline, got {given['mode']!r}")
    return given


def check(cfg) -> None:
    """Before any process starts: the ``wandb`` key's shape, and that wandb is installed."""
    if _given(cfg.get("wandb")) is None:
        return
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb", "needs the wandb package: pip install 'echelon3[wandb]' "
                          "(or set wandb: false)")


def settings(cfg, config_file: Path | None = None) -> Settings | None:
    """The resolved settings, or None when the ``wandb`` key is off or absent."""
    given = _given(cfg.get("wandb"))
    if given is None:
        return None
    folder = Path(str((cfg.get("target") or {}).get("path") or "run"))
    name = Path(config_file).stem if config_file else folder.name
    return Settings(
        project=given.get("project") or os.environ.get("WANDB_PROJECT")
        or os.environ.get(SWEEP_ENV) or name,
        entity=given.get("entity") or os.environ.get("WANDB_ENTITY") or None,
        mode=given.get("mode") or os.environ.get("WANDB_MODE") or "online",
        run_name=given.get("run_name") or os.environ.get(EXPERIMENT_ENV) or folder.name,
        group=given.get("group") or os.environ.get(SWEEP_ENV) or None,
        dir=str(Path(given.get("dir") or os.environ.get("WANDB_DIR") or folder).resolve()))
