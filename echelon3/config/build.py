"""From ``module`` / ``type`` / ``config`` triples to objects: one path for every component.

``module`` is an import path or a path to a ``.py`` file (relative paths are
looked up against the config's directory, then the current directory);
``type`` names a class or a factory function in it; ``config`` holds keyword
arguments. Nested triples inside ``config`` are built first, unless the target
lists that argument in its ``lazy_specs`` attribute (it then receives the raw
mapping and builds it itself, e.g. an optimizer that needs ``params=``).

Runtime objects (parameters, datasets, the optimizer) are injected by the
section builders (:mod:`echelon3.tasks.components`), each naming what it injects;
a YAML that sets one of them is an error.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import sys
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf

from echelon3.config.arguments import check_arguments, check_call, partial_hint, to_tensors
from echelon3.config.errors import BuildError, UserError, did_you_mean

SPEC_KEYS = {"module", "type", "config", "partial"}

# The config directory of the component being constructed, so that a container
# building its lazy specs itself finds ``.py`` files beside the config too.
_CONFIG_DIR: ContextVar[Path | None] = ContextVar("echelon3_config_dir", default=None)


def is_spec(node: Any) -> bool:
    """A mapping with ``module`` and ``type`` (and optionally ``config``, ``weight``...)."""
    return isinstance(node, Mapping | DictConfig) and "module" in node and "type" in node


def to_plain(node: Any) -> Any:
    if isinstance(node, DictConfig | ListConfig):
        return OmegaConf.to_container(node, resolve=True)
    return node


def _load_file_module(path: Path, key: str):
    """A ``.py`` file as a module under a stable name (the same in every process, so
    ``torch.compile`` and pickling find it in ``sys.modules``). While it runs, its folder
    comes first on ``sys.path``: ``from model import GPT`` finds ``model.py`` beside it,
    which then stays in ``sys.modules`` as ``model``. The folder is taken off again, so a
    dotted ``module:`` never finds a file beside the config by accident."""
    name = "echelon3_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12] + "_" + path.stem
    if name in sys.modules:
        return sys.modules[name]
    same = _already_imported(path)  # imported as a sibling of an earlier file
    if same is not None:
        sys.modules[name] = same
        return same
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise BuildError(f"{key}.module", f"importing {path} failed: "
                         f"{type(e).__name__}: {e}") from e
    finally:
        sys.path.remove(folder)
    return module


def _already_imported(path: Path):
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and not getattr(module, "__path__", None) and Path(file) == path:
            return module
    return None


def import_module(name: str, key: str, config_dir: Path | None = None):
    """Import ``name`` (dotted path or ``.py`` file) or fail naming ``key.module``."""
    if not isinstance(name, str) or not name:
        raise BuildError(f"{key}.module", f"must be an import path or a .py file, got {name!r}")
    if name.endswith(".py") or "/" in name:
        candidates = [Path(name)] if Path(name).is_absolute() else [
            *([config_dir / name] if config_dir else []), Path.cwd() / name]
        for path in candidates:
            if path.is_file():
                return _load_file_module(path.resolve(), key)
        raise BuildError(f"{key}.module", "file not found: "
                         + " or ".join(str(p) for p in candidates))
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            file = name.replace(".", "/") + ".py"
            hint = (f"; to load {config_dir / file} next to the config, write "
                    f"module: {file}") if config_dir and (config_dir / file).is_file() else ""
            raise BuildError(f"{key}.module", f"cannot import '{name}' "
                             f"(no module named '{e.name}'){hint}") from e
        raise BuildError(f"{key}.module", f"importing '{name}' failed: {e}") from e
    except Exception as e:
        raise BuildError(f"{key}.module", f"importing '{name}' failed: "
                         f"{type(e).__name__}: {e}") from e


def resolve_type(spec: Mapping, key: str, config_dir: Path | None = None) -> Callable:
    module = import_module(spec["module"], key, config_dir)
    name = spec["type"]
    target = module
    for part in str(name).split("."):
        if not hasattr(target, part):
            public = [n for n in dir(module) if not n.startswith("_")]
            raise BuildError(f"{key}.type", f"'{spec['module']}' has no attribute '{name}'"
                             f"{did_you_mean(str(name), public)}")
        target = getattr(target, part)
    if not callable(target):
        raise BuildError(f"{key}.type", f"'{spec['module']}.{name}' is not a class or function")
    return target


def _build_nested(value: Any, key: str, config_dir: Path | None) -> Any:
    if is_spec(value):
        return instantiate(value, key, config_dir)
    if isinstance(value, Mapping | DictConfig):
        return {k: _build_nested(v, f"{key}.{k}", config_dir) for k, v in value.items()}
    if isinstance(value, list | ListConfig):
        return [_build_nested(v, f"{key}[{i}]", config_dir) for i, v in enumerate(value)]
    return value


def instantiate(spec: Mapping, key: str, config_dir: Path | None = None,
                extra_keys: tuple[str, ...] = (), **injected: Any) -> Any:
    """Build one triple. ``injected`` are runtime objects the section supplies.

    Without ``config_dir``, the one of the component under construction is used.
    """
    if config_dir is None:
        config_dir = _CONFIG_DIR.get()
    if not is_spec(spec):
        raise BuildError(key, "needs 'module' and 'type'")
    if isinstance(spec, DictConfig):
        missing = sorted(OmegaConf.missing_keys(spec))
        if missing:
            raise BuildError(missing[0], "has no value ('???'); set it in the YAML or with "
                             f"{missing[0]}=...")
    allowed = SPEC_KEYS | set(extra_keys)
    for k in spec:
        if k not in allowed:
            raise BuildError(f"{key}.{k}", f"unknown key{did_you_mean(str(k), allowed)}; "
                             f"a component takes {', '.join(sorted(allowed))}")
    target = resolve_type(spec, key, config_dir)
    config = spec.get("config") or {}
    if not isinstance(config, Mapping | DictConfig):
        raise BuildError(f"{key}.config", f"must be a mapping of keyword arguments, got {config!r}")
    for name in injected:
        if name in config:
            raise BuildError(f"{key}.config.{name}", f"'{name}' is supplied by echelon3 at "
                             "run time; remove it from the config")
    partial = _partial_flag(spec, key)
    lazy = set(getattr(target, "lazy_specs", ()))
    kwargs = {k: (to_plain(v) if k in lazy else _build_nested(v, f"{key}.config.{k}", config_dir))
              for k, v in config.items()}
    kwargs = to_tensors(target, {k: to_plain(v) for k, v in kwargs.items()}, skip=lazy)
    kwargs.update(injected)
    if partial:
        check_arguments(target, kwargs, key, injected, skip_types=tuple(lazy), require=False)
        return functools.partial(target, **kwargs) if kwargs else target
    check_call(target, kwargs, key, injected, skip_types=tuple(lazy))
    token = _CONFIG_DIR.set(config_dir)
    try:
        return target(**kwargs)
    except UserError:
        raise
    except (TypeError, ValueError) as e:
        raise BuildError(key, f"{getattr(target, '__qualname__', target)} rejected its "
                         f"arguments: {e}{partial_hint(target, e, key)}") from e
    finally:
        _CONFIG_DIR.reset(token)


def _partial_flag(spec: Mapping, key: str) -> bool:
    flag = spec.get("partial", False)
    if not isinstance(flag, bool):
        raise BuildError(f"{key}.partial", f"must be true or false, got {flag!r}")
    return flag


def iter_specs(node: Any, key: str):
    """Every triple under ``node`` as (config path, spec), outer ones first."""
    if is_spec(node):
        yield key, node
        node = node.get("config")
        key = f"{key}.config"
    if isinstance(node, Mapping | DictConfig):
        for k, v in node.items():
            yield from iter_specs(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list | ListConfig):
        for i, item in enumerate(node):
            # A root section listing `- name: triple` (loss, metrics) names entries by name.
            if "." not in key and isinstance(item, Mapping | DictConfig) and len(item) == 1:
                yield from iter_specs(item, key)
            else:
                yield from iter_specs(item, f"{key}[{i}]")


def named_items(node: Any, key: str) -> list[tuple[str, Any]]:
    """``[{name: spec}, ...]`` or ``{name: spec, ...}`` -> [(name, spec)]."""
    if node is None:
        return []
    if isinstance(node, Mapping | DictConfig):
        return list(node.items())
    items = []
    for i, item in enumerate(node):
        if not isinstance(item, Mapping | DictConfig) or len(item) != 1:
            raise BuildError(f"{key}[{i}]", "each entry must be a one-key mapping 'name: {module, "
                             "type, config}'")
        items.extend(item.items())
    return items


def with_default_type(node: Any, key: str, module: str, type_: str) -> dict:
    """A section whose ``module``/``type`` may be left out in favour of a built-in.

    Without them its settings may sit under ``config:`` or directly in the section
    (``evaluator.output`` and ``evaluator.config.output`` mean the same).
    """
    node = to_plain(node) or {}
    if not isinstance(node, dict):
        raise BuildError(key, f"must be a mapping, got {node!r}")
    if "module" in node or "type" in node:
        if ("module" in node) != ("type" in node):
            raise BuildError(key, "give both 'module' and 'type', or neither for the built-in")
        return node
    if "config" in node and len(node) > 1:
        other = next(k for k in node if k != "config")
        raise BuildError(f"{key}.{other}", "put settings either under 'config' or directly in "
                         f"'{key}', not both")
    return {"module": module, "type": type_, "config": node.get("config", node)}
