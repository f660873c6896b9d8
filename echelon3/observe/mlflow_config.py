"""The ``mlflow`` root key, checked before any process starts, and its defaults.

See :mod:`echelon3.observe.mlflow` for what is tracked."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from echelon3.config.errors import ConfigError, did_you_mean
from echelon3.observe.mlflow_run import EXPERIMENT_ENV, SWEEP_ENV

KEYS = ("tracking_uri", "experiment", "run_name", "log_models")


@dataclass(frozen=True)
class Settings:
    tracking_uri: str
    experiment: str
    run_name: str
    log_models: bool


def _given(node) -> dict | None:
    """The ``mlflow`` key as a dict, or None when tracking is off."""
    if node is None or node is False:
        return None
    if node is True:
        return {}
    if not isinstance(node, DictConfig | dict):
        raise ConfigError("mlflow", f"must be true, false or a mapping with keys "
                          f"{', '.join(KEYS)}; got {node!r}")
    given = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) \
        else dict(node)
    for key, value in given.items():
        if key not in KEYS:
            raise ConfigError(f"mlflow.{key}", f"unknown key{did_you_mean(str(key), KEYS)}; "
                              f"known: {', '.join(KEYS)}")
        if key == "log_models" and not isinstance(value, bool):
            raise ConfigError("mlflow.log_models", f"takes true or false, got {value!r}")
        if key != "log_models" and value is not None and (not isinstance(value, str)
                                                           or not value.strip()):
            raise ConfigError(f"mlflow.{key}", f"must be a non-empty string, got {value!r}")
    return given


def check(cfg) -> None:
    """Before any process starts: the ``mlflow`` key's shape, and that MLflow is installed."""
    if _given(cfg.get("mlflow")) is None:
        return
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError("mlflow", "needs the mlflow package: pip install 'echelon3[mlflow]' "
                          "(or set mlflow: false)")


def default_uri() -> str:
    """What ``mlflow ui`` run here opens (``mlflow.db``, or ``./mlruns`` when it holds a
    store), as an absolute URI, so that every attempt of a run finds the same store."""
    import mlflow

    uri = mlflow.get_tracking_uri()  # MLFLOW_TRACKING_URI is unset here: MLflow's default
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{Path(uri[len('sqlite:///'):]).resolve()}"
    if "://" not in uri:
        return Path(uri).resolve().as_uri()
    return uri


def settings(cfg, config_file: Path | None = None) -> Settings | None:
    """The resolved settings, or None when the ``mlflow`` key is off or absent."""
    given = _given(cfg.get("mlflow"))
    if given is None:
        return None
    folder = Path(str((cfg.get("target") or {}).get("path") or "run"))
    name = Path(config_file).stem if config_file else folder.name
    return Settings(
        tracking_uri=given.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
        or default_uri(),
        experiment=given.get("experiment") or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        or os.environ.get(SWEEP_ENV) or name,
        run_name=given.get("run_name") or os.environ.get(EXPERIMENT_ENV) or folder.name,
        log_models=bool(given.get("log_models", False)))
