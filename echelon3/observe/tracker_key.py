"""The shape every tracker's root key has (``mlflow``, ``wandb``): true, false or a mapping
of known keys, each a non-empty string (or, for a flag, true or false)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from echelon3.config.errors import ConfigError, did_you_mean


def given(node, root: str, keys: tuple[str, ...], flags: tuple[str, ...] = ()) -> dict | None:
    """The ``root`` key as a dict, or None when tracking is off."""
    if node is None or node is False:
        return None
    if node is True:
        return {}
    if not isinstance(node, DictConfig | dict):
        raise ConfigError(root, f"must be true, false or a mapping with keys "
                          f"{', '.join(keys)}; got {node!r}")
    found = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) \
        else dict(node)
    for key, value in found.items():
        if key not in keys:
            raise ConfigError(f"{root}.{key}", f"unknown key{did_you_mean(str(key), keys)}; "
                              f"known: {', '.join(keys)}")
        if key in flags:
            if not isinstance(value, bool):
                raise ConfigError(f"{root}.{key}", f"takes true or false, got {value!r}")
        elif value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{root}.{key}", f"must be a non-empty string, got {value!r}")
    return found
