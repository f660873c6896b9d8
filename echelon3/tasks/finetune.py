"""Warm starts: ``init_from`` (weights from another run) and ``finetune`` (freezing, per-group lr).

```yaml
init_from: {checkpoint: results/digits_mlp/best.tar, strict: false}
finetune:
  freeze_patterns: ['^layers\\.1\\.']              # regexes, searched in parameter names
  param_groups: [{pattern: '^layers\\.4\\.', lr_mult: 10.0}]
```

``init_from`` loads network weights only (an echelon3 checkpoint or a bare
state_dict; ``module.`` / ``_orig_mod.`` prefixes stripped), and only when the
run starts fresh: a run that resumes takes its weights from its own checkpoint.
With ``strict: false`` tensors whose name and shape match are loaded and one line
lists what was loaded, skipped (shape differs or not in the network) and missing
(in the network, not in the checkpoint). The source's identity (a hash of its
weights) is recorded as ``init_from.sha256``, so it is part of the run's
fingerprint and saved config: new parent weights make a new run.

Frozen parameters get ``requires_grad = False`` before the optimizer and DDP
are built, so neither sees them (DDP registers only parameters that require
grad, so they are not searched for unused gradients either). ``param_groups``
give the first group whose pattern matches a parameter ``lr = optimizer lr x
lr_mult``; the rest stay in a default group at the optimizer's ``lr``.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from echelon3.checkpoints.files import strip_prefixes
from echelon3.config.errors import CheckpointError, ConfigError
from echelon3.data import splits

log = logging.getLogger(__name__)

INIT_KEYS = ("checkpoint", "strict", "sha256")  # sha256: written by echelon3
FINETUNE_KEYS = ("freeze_patterns", "param_groups")


def _section(cfg, name: str, known: tuple[str, ...]) -> dict[str, Any]:
    node = cfg.get(name)
    if node is None:
        return {}
    node = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    if not isinstance(node, dict):
        raise ConfigError(name, f"must be a mapping with keys {', '.join(known)}, got {node!r}")
    for key in node:
        if key not in known:
            raise ConfigError(f"{name}.{key}", f"unknown key; {name} takes {', '.join(known)}")
    return node


def init_settings(cfg) -> dict[str, Any]:
    """``init_from`` checked: {} when absent, else {'checkpoint': str, 'strict': bool}."""
    node = _section(cfg, "init_from", INIT_KEYS)
    if not node:
        return {}
    if not isinstance(node.get("checkpoint"), str) or not node["checkpoint"]:
        raise ConfigError("init_from.checkpoint", "required: the path of the checkpoint "
                          "(or state_dict file) whose weights start the run")
    strict = node.get("strict", True)
    if not isinstance(strict, bool):
        raise ConfigError("init_from.strict", f"must be true or false, got {strict!r}")
    return {"checkpoint": node["checkpoint"], "strict": strict}


def source_path(checkpoint: str, config_dir: Path | None) -> Path:
    """As ``net.weights``: beside the config if it is there, else as given (cwd)."""
    path = Path(checkpoint).expanduser()
    if not path.is_absolute() and config_dir is not None and (config_dir / path).exists():
        return config_dir / path
    return path


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Network weights of an echelon3 checkpoint or a bare state_dict, prefixes stripped."""
    return read_source(path)[0]


def read_source(path: Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(weights, how its run's validation split was drawn: None when the file does not
    say) of an echelon3 checkpoint or a bare state_dict."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError("init_from.checkpoint", f"{path} not found (train the run it "
                              "comes from first)") from None
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError("init_from.checkpoint", f"cannot load {path} ({reason})") from e
    split = None
    if isinstance(data, dict) and "model_state_dict" in data:
        split = data.get(splits.RECORD)
        data = data["model_state_dict"]
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise CheckpointError("init_from.checkpoint", f"{path} holds no network weights")
    return strip_prefixes(data), split


def weights_hash(state: dict[str, torch.Tensor]) -> str:
    """Identity of a set of weights: names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def load_partial(net: torch.nn.Module, state: dict[str, torch.Tensor], source: str,
                 strict: bool) -> dict[str, list[str]]:
    """Load ``state`` into ``net``; returns the loaded / skipped / missing names."""
    own = net.state_dict()
    loaded = [k for k, v in state.items() if k in own and own[k].shape == v.shape]
    skipped = [k for k in state if k not in loaded]
    missing = [k for k in own if k not in state]
    if strict and (skipped or missing):
        first = skipped[0] if skipped else missing[0]
        why = ("is not in the network" if first not in own else "has another shape") \
            if skipped else "is missing from the checkpoint"
        raise CheckpointError("init_from.checkpoint", f"{source} does not fit the network: "
                              f"'{first}' {why} ({len(skipped)} skipped, {len(missing)} missing); "
                              "set init_from.strict=false to load what fits")
    net.load_state_dict({k: state[k] for k in loaded}, strict=False)

    def names(keys: list[str]) -> str:
        return f" ({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''})" if keys else ""

    log.info("init_from %s: loaded %d tensors, skipped %d%s, missing %d%s", source,
             len(loaded), len(skipped), names(skipped), len(missing), names(missing))
    return {"loaded": loaded, "skipped": skipped, "missing": missing}


class WarmStart:
    """``init_from`` + ``finetune`` of one run, checked when built (before any weights load)."""

    def __init__(self, cfg, config_dir: Path | None = None):
        self.init = init_settings(cfg)
        node = _section(cfg, "finetune", FINETUNE_KEYS)
        self.freeze = _patterns(node.get("freeze_patterns") or [], "finetune.freeze_patterns")
        self.groups = _groups(node.get("param_groups") or [])
        self.path = source_path(self.init["checkpoint"], config_dir) if self.init else None
        self._state: dict[str, torch.Tensor] | None = None
        self._split: dict | None = None

    def source(self) -> dict[str, torch.Tensor] | None:
        if self.path is not None and self._state is None:
            self._state, self._split = read_source(self.path)
        return self._state

    def split(self, data, seed: int) -> tuple | None:
        """(fraction, seed) this run carves ``data.val_split`` with: its parent's when it
        starts from an echelon3 run on the same data (:func:`echelon3.data.splits.for_child`)."""
        self.source()
        return splits.for_child(data, seed, self._split, str(self.path))

    def identity(self) -> str | None:
        """Hash of the source weights, or None without ``init_from``."""
        state = self.source()
        return weights_hash(state) if state is not None else None

    def record(self, cfg) -> None:
        """Write the source weights' hash into the config as ``init_from.sha256``: it is then
        part of the run's fingerprint and of its saved config.yaml."""
        if self.path is not None:
            cfg.init_from.sha256 = self.identity()

    def load(self, net: torch.nn.Module) -> None:
        """Warm start a fresh run (a resumed one has its own weights)."""
        if self.path is not None:
            load_partial(net, self.source(), str(self.path), self.init["strict"])

    def apply(self, net: torch.nn.Module) -> list[dict[str, Any]] | list[torch.nn.Parameter]:
        """Freeze, then the optimizer's ``params=``: a list of groups, or the trainable list."""
        named = list(net.named_parameters())
        for i, pattern in enumerate(self.freeze):
            hits = [p for name, p in named if pattern.search(name)]
            if not hits:
                raise _no_match(f"finetune.freeze_patterns[{i}]", pattern, named)
            for p in hits:
                p.requires_grad_(False)
        frozen = sum(p.numel() for _, p in named if not p.requires_grad)
        if self.freeze:
            log.info("finetune: %d of %d parameter values frozen", frozen,
                     sum(p.numel() for _, p in named))
        trainable = [(name, p) for name, p in named if p.requires_grad]
        if not self.groups:
            return [p for _, p in trainable]
        groups = [{"params": [], "lr_mult": mult} for _, mult in self.groups]
        rest: list[torch.nn.Parameter] = []
        for i, (pattern, _) in enumerate(self.groups):
            if not any(pattern.search(name) for name, _ in trainable):
                raise _no_match(f"finetune.param_groups[{i}].pattern", pattern, trainable,
                                "trainable parameter")
        for name, p in trainable:
            index = next((i for i, (pat, _) in enumerate(self.groups) if pat.search(name)), None)
            (rest if index is None else groups[index]["params"]).append(p)
        groups = [g for g in groups if g["params"]]
        return [*groups, {"params": rest, "lr_mult": 1.0}] if rest else groups


def scale_group_lrs(optimizer) -> None:
    """Groups built by :meth:`WarmStart.apply` carry ``lr_mult``: lr = optimizer lr x mult."""
    base = optimizer.defaults.get("lr")
    for group in optimizer.param_groups:
        if "lr_mult" in group:
            if base is None:
                raise ConfigError("finetune.param_groups", f"{type(optimizer).__name__} has no "
                                  "lr to multiply")
            group["lr"] = float(base) * float(group["lr_mult"])


def _patterns(values, key: str) -> list[re.Pattern]:
    if not isinstance(values, list):
        raise ConfigError(key, f"must be a list of regular expressions, got {values!r}")
    return [_compile(v, f"{key}[{i}]") for i, v in enumerate(values)]


def _compile(value, key: str) -> re.Pattern:
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"must be a regular expression, got {value!r}")
    try:
        return re.compile(value)
    except re.error as e:
        raise ConfigError(key, f"'{value}' is not a regular expression: {e}") from e


def _groups(values) -> list[tuple[re.Pattern, float]]:
    key = "finetune.param_groups"
    if not isinstance(values, list):
        raise ConfigError(key, f"must be a list of {{pattern, lr_mult}}, got {values!r}")
    groups = []
    for i, group in enumerate(values):
        if not isinstance(group, dict) or set(group) - {"pattern", "lr_mult"} \
                or "pattern" not in group:
            raise ConfigError(f"{key}[{i}]", f"must be {{pattern: regex, lr_mult: number}}, "
                              f"got {group!r}")
        mult = group.get("lr_mult", 1.0)
        if isinstance(mult, bool) or not isinstance(mult, int | float) or mult < 0:
            raise ConfigError(f"{key}[{i}].lr_mult", f"must be a number >= 0, got {mult!r}")
        groups.append((_compile(group["pattern"], f"{key}[{i}].pattern"), float(mult)))
    return groups


def _no_match(key: str, pattern: re.Pattern, named, what: str = "parameter") -> ConfigError:
    sample = ", ".join(name for name, _ in named[:6]) + (", ..." if len(named) > 6 else "")
    return ConfigError(key, f"'{pattern.pattern}' matches no {what}; {what}s are: "
                       f"{sample or '(none)'}")
