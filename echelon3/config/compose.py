"""Loading a run's YAML: ``defaults:`` composition, command-line overrides, resolution.

Built on OmegaConf alone. The ``defaults:`` list follows the familiar Hydra
shape for the forms that matter for one-file-per-run configs:

- ``- name``            merges ``name.yaml`` at the root,
- ``- group: option``   merges ``group/option.yaml`` under ``group``
  (``data/aug: heavy`` merges ``data/aug/heavy.yaml`` under ``data.aug``),
- ``- group: null``     selects nothing,
- ``- _self_``          places the file's own keys (last when omitted).

As in Hydra, names in a file inside a group folder are looked up in that folder
first (``data/small.yaml`` listing ``- aug: heavy`` finds
``data/aug/heavy.yaml``), then in the config directory; a leading ``/``
(``- /base``) means the config directory only. Other forms (``@package``,
``override``, ``optional``) are rejected with a clear error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from echelon3.config import derived  # registers ${calc:...}
from echelon3.config.errors import ConfigError, did_you_mean

# Root keys the framework knows. A root key starting with "_" is the user's own
# (handy as an interpolation source) and is left alone.
ROOT_KEYS = (
    "device", "gpus", "nproc", "precision", "seed", "device_ids", "on_config_change",
    "net", "data", "dataloaders", "loss", "metrics", "optimizer", "scheduler",
    "trainer", "target", "mlops", "evaluator", "runner", "init_from", "finetune", "export",
    "strategy", "fsdp", "activation_checkpointing",
    "mlflow", "wandb", "resume_from",
)

_KEY = re.compile(r"^[A-Za-z_][\w\-]*(\.[\w\-]+|\[\d+\])*$")


@dataclass
class RunConfig:
    """The composed config and where it came from."""

    cfg: DictConfig
    config_dir: Path
    config_file: Path


def _config_file(config_dir: Path, name: str, key: str) -> Path:
    name = name[:-5] if name.endswith(".yaml") else name
    path = config_dir / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(key, f"config file not found: {path}")
    return path


def _default_file(config_dir: Path, here: Path, name: str, key: str) -> Path:
    """``name`` as listed in ``defaults:`` of a file in folder ``here`` (see module doc)."""
    if name.startswith("/"):
        return _config_file(config_dir, name.lstrip("/"), key)
    stem = name[:-5] if name.endswith(".yaml") else name
    tried = []
    for base in dict.fromkeys((here, config_dir)):
        path = (base / f"{stem}.yaml").resolve()
        if path.is_file():
            return path
        tried.append(str(path))
    raise ConfigError(key, f"config file not found: {' or '.join(tried)}")


def _read_yaml(path: Path) -> DictConfig:
    try:
        node = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        first = _first_line(str(e))
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or first
        raise ConfigError(str(path), f"not valid YAML{where}: {problem}") from e
    if node is None or isinstance(node, ListConfig):
        if node is None or len(node) == 0:
            return OmegaConf.create({})
        raise ConfigError(str(path), "the top level must be a mapping, not a list")
    return node


def _parse_default(entry: Any, path: Path) -> tuple[str | None, str | None]:
    """One ``defaults:`` entry -> (group or None, option name or None)."""
    where = f"{path}: defaults"
    if isinstance(entry, str):
        if entry.startswith(("override ", "optional ")) or "@" in entry:
            raise ConfigError(where, f"unsupported defaults form '{entry}' "
                              "(supported: '- name', '- group: option', '- _self_')")
        return None, entry
    if isinstance(entry, dict) and len(entry) == 1 and isinstance(next(iter(entry)), str):
        group, option = next(iter(entry.items()))
        if group.startswith(("override ", "optional ")) or "@" in group:
            raise ConfigError(where, f"unsupported defaults form '{group}' "
                              "(supported: '- name', '- group: option', '- _self_')")
        if option is not None and not isinstance(option, str):
            raise ConfigError(where, f"option for group '{group}' must be a name, got {option!r}")
        return group, option
    raise ConfigError(where, f"cannot read entry {entry!r} "
                      "(supported: '- name', '- group: option', '- _self_')")


def _first_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


def _compose(config_dir: Path, path: Path, stack: tuple[Path, ...]) -> DictConfig:
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(p.name for p in (*stack, path))
        raise ConfigError(f"{stack[-1]}: defaults", f"defaults cycle: {chain}")
    node = _read_yaml(path)
    defaults = node.pop("defaults", None) if "defaults" in node else None
    if defaults is None:
        return node
    if not isinstance(defaults, ListConfig):
        raise ConfigError(f"{path}: defaults", "must be a list")
    entries = [_parse_default(e, path) for e in OmegaConf.to_container(defaults)]
    if (None, "_self_") not in entries:
        entries.append((None, "_self_"))
    here = path.parent
    merged = OmegaConf.create({})
    for group, option in entries:
        if group is None and option == "_self_":
            merged = OmegaConf.merge(merged, node)
        elif group is None:
            child = _default_file(config_dir, here, option, f"{path}: defaults")
            merged = OmegaConf.merge(merged, _compose(config_dir, child, (*stack, path)))
        elif option is not None:
            child = _default_file(config_dir, here, f"{group}/{option}",
                                  f"{path}: defaults: {group}")
            group = group.lstrip("/")
            sub = _compose(config_dir, child, (*stack, path))
            wrapped = OmegaConf.create({})
            OmegaConf.update(wrapped, group.replace("/", "."), sub, force_add=True)
            merged = OmegaConf.merge(merged, wrapped)
    return merged


def is_hydra_key(key: str) -> bool:
    """``hydra``, ``hydra.run.dir``, ``hydra/launcher``: Hydra's own settings."""
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def parse_override(text: str) -> tuple[str, str, Any]:
    """``key=value`` / ``+key=value`` / ``++key=value`` / ``~key`` -> (op, key, value).

    Values are typed by OmegaConf (``3``, ``0.1``, ``true``, ``null``, ``[0,1]``,
    ``{a: 1}``, text); interpolations such as ``${oc.env:VAR,default}`` or
    ``${net.config.hidden}`` are kept and resolved with the whole config.
    """
    if text.startswith("~"):
        key = text[1:].split("=", 1)[0]
        op, value = "delete", None
    else:
        if "=" not in text:
            raise ConfigError(f"override '{text}'",
                              "malformed: expected key=value, +key=value, ++key=value or ~key")
        body = text[2:] if text.startswith("++") else text.removeprefix("+")
        key, raw = body.split("=", 1)
        op = "set"
        if is_hydra_key(key):
            return op, key, raw
        try:
            value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]))["v"]
        except (yaml.YAMLError, OmegaConfBaseException) as e:
            raise ConfigError(f"override '{text}'", f"cannot parse value '{raw}'") from e
    if is_hydra_key(key):
        return op, key, value
    if not _KEY.match(key):
        raise ConfigError(f"override '{text}'", f"malformed key '{key}'")
    return op, key, value


def _delete(cfg: DictConfig, key: str, text: str) -> None:
    parent, _, last = key.replace("[", ".").replace("]", "").rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    if isinstance(node, ListConfig) and last.isdigit() and int(last) < len(node):
        del node[int(last)]
        return
    if not isinstance(node, DictConfig) or last not in node:
        raise ConfigError(key, f"cannot delete (override '{text}'): no such key")
    del node[last]


def apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> None:
    for text in overrides:
        op, key, value = parse_override(text)
        if is_hydra_key(key):
            continue  # accepted for Hydra-style command lines; nothing to do
        if op == "delete":
            _delete(cfg, key, text)
        else:
            try:
                OmegaConf.update(cfg, key, value, merge=False, force_add=True)
            except (OmegaConfBaseException, ValueError, TypeError, KeyError, IndexError) as e:
                raise ConfigError(key, f"cannot apply override '{text}': "
                                  f"{_first_line(getattr(e, 'msg', None) or e)}") from e


def _root(key: str) -> str:
    return re.split(r"[.\[]", key, maxsplit=1)[0]


def _check_root_keys(cfg: DictConfig, source: Path, added: dict[str, str]) -> None:
    """``added``: root keys the command line brought in -> the override that did."""
    for key in cfg:
        if key not in ROOT_KEYS and not str(key).startswith("_"):
            where = f"override '{added[key]}' on the command line" if key in added \
                else source.name
            raise ConfigError(str(key), f"unknown root key in {where}"
                              f"{did_you_mean(str(key), ROOT_KEYS)}; known: {', '.join(ROOT_KEYS)}")


def _resolve(cfg: DictConfig) -> None:
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        raise ConfigError(str(key), f"cannot resolve interpolation: "
                          f"{_first_line(e.msg)}") from e


def load_config(config_dir: str | Path | None, config_name: str,
                overrides: Sequence[str] = ()) -> RunConfig:
    """Compose ``config_dir/config_name.yaml``, apply overrides, resolve interpolations
    (a ``${calc:...}`` waits for the run's facts: :mod:`echelon3.config.derived`)."""
    directory = Path(config_dir or ".").expanduser().resolve()
    if not directory.is_dir():
        raise ConfigError("--config-dir", f"config directory not found: {directory}")
    if not config_name:
        raise ConfigError("--config-name", "missing; name the run's YAML file")
    path = _config_file(directory, config_name, "--config-name")
    cfg = _compose(directory, path, ())
    in_files = set(cfg)
    added = {_root(parse_override(o)[1]): o for o in overrides}
    apply_overrides(cfg, overrides)
    cfg.pop("hydra", None)
    _resolve(cfg)
    _check_root_keys(cfg, path, {k: o for k, o in added.items() if k not in in_files})
    derived.check(cfg)
    return RunConfig(cfg=cfg, config_dir=directory, config_file=path)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{a: {b: 1}}`` -> ``{"a.b": 1}``: every leaf under its dotted key."""
    if isinstance(node, dict) and node:
        flat = {}
        for key, value in node.items():
            flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: node}


def changed_keys(old: dict, new: dict, limit: int = 4) -> list[str]:
    """``key: old -> new`` for each leaf that differs (at most ``limit``, then a count)."""
    before, after = flatten(old), flatten(new)
    absent = object()

    def show(value):
        return "(absent)" if value is absent else repr(value)

    lines = [f"{key}: {show(before.get(key, absent))} -> {show(after.get(key, absent))}"
             for key in sorted(before.keys() | after.keys())
             if before.get(key, absent) != after.get(key, absent)]
    if len(lines) > limit:
        lines = [*lines[:limit - 1], f"and {len(lines) - limit + 1} more"]
    return lines


def require(cfg: DictConfig, *sections: str, task: str) -> None:
    """Fail with the section's name when a required section is absent."""
    for section in sections:
        if cfg.get(section) is None:
            raise ConfigError(section, f"required section missing for '{task}'")
