"""Weight-decay rules: which parameters the optimizer decays, and which it leaves alone.

``optimizer.no_decay`` names the parameters that go to a group of their own with
``weight_decay: 0.0``; the rest keep the optimizer's ``weight_decay``::

    optimizer:
      module: torch.optim
      type: AdamW
      config: {lr: 0.0006, weight_decay: 0.1}
      no_decay:
        ndim_below: 2                     # biases, norm weights (nanoGPT: decay 2-D only)
        modules: [LayerNorm, Embedding]   # parameters these module types hold
        names: ['*.bias']                 # fnmatch patterns over parameter names

A parameter matching any rule is not decayed. ``modules`` are class names, matched
against a module's class and its bases; a parameter shared by two modules (tied
weights) is held by both. A ``modules`` or ``names`` entry that matches no parameter of
the network is an error naming its key. The rules compose with ``finetune``: each group
handed over (``lr_mult``) is split in two, and frozen parameters, which are not handed
over, stay out.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any, Mapping

import torch

from echelon3.config.errors import ConfigError

log = logging.getLogger(__name__)

KEY = "optimizer.no_decay"
RULES = ("ndim_below", "modules", "names")


class NoDecay:
    """The rules of ``optimizer.no_decay``, checked when built."""

    def __init__(self, ndim_below: int | None = None, modules=(), names=()):
        if ndim_below is not None and (isinstance(ndim_below, bool)
                                       or not isinstance(ndim_below, int) or ndim_below < 1):
            raise ConfigError(f"{KEY}.ndim_below", f"must be a whole number >= 1, got "
                              f"{ndim_below!r}")
        self.ndim_below = ndim_below
        self.modules = _strings(modules, "modules")
        self.names = _strings(names, "names")

    @classmethod
    def from_config(cls, node: Any) -> "NoDecay":
        if not isinstance(node, Mapping):
            raise ConfigError(KEY, f"must be a mapping of {', '.join(RULES)}, got {node!r}")
        for k in node:
            if k not in RULES:
                raise ConfigError(f"{KEY}.{k}", f"unknown rule; no_decay takes "
                                  f"{', '.join(RULES)}")
        return cls(**dict(node))

    def held_by_types(self, net: torch.nn.Module) -> dict[int, set[str]]:
        """{id(parameter): the ``modules`` names among the classes of the modules holding it}."""
        held: dict[int, set[str]] = {}
        for module in net.modules():
            classes = {c.__name__ for c in type(module).__mro__}
            hits = classes.intersection(self.modules)
            for p in module.parameters(recurse=False):
                held.setdefault(id(p), set()).update(hits)
        return held

    def exempt(self, net: torch.nn.Module) -> set[int]:
        """The ids of ``net``'s parameters not to decay; a rule matching none is an error."""
        held = self.held_by_types(net)
        named = list(net.named_parameters())
        for i, name in enumerate(self.modules):
            if not any(name in hits for hits in held.values()):
                raise ConfigError(f"{KEY}.modules[{i}]", f"no parameter of the network is held "
                                  f"by a {name}; its module types are: "
                                  f"{', '.join(sorted({type(m).__name__ for m in net.modules()}))}")
        for i, pattern in enumerate(self.names):
            if not any(fnmatch.fnmatchcase(n, pattern) for n, _ in named):
                sample = ", ".join(n for n, _ in named[:6]) + (", ..." if len(named) > 6 else "")
                raise ConfigError(f"{KEY}.names[{i}]", f"'{pattern}' matches no parameter "
                                  f"name; names are: {sample or '(none)'}")
        return {id(p) for n, p in named
                if (self.ndim_below is not None and p.ndim < self.ndim_below)
                or held.get(id(p)) or any(fnmatch.fnmatchcase(n, pat) for pat in self.names)}

    def groups(self, net: torch.nn.Module, params) -> list[dict[str, Any]]:
        """``params`` (parameters, or groups of them) as groups: each one split into its
        decayed parameters and the rest at ``weight_decay`` 0.0; empty ones left out."""
        exempt = self.exempt(net)
        params = list(params)
        given = params if params and isinstance(params[0], Mapping) else [{"params": params}]
        out = []
        for group in given:
            members = list(group["params"])
            decay = [p for p in members if id(p) not in exempt]
            rest = [p for p in members if id(p) in exempt]
            if decay:
                out.append({**group, "params": decay})
            if rest:
                out.append({**group, "params": rest, "weight_decay": 0.0})
        return out


def _strings(values, rule: str) -> list[str]:
    if isinstance(values, str) or not all(isinstance(v, str) and v for v in values):
        raise ConfigError(f"{KEY}.{rule}", f"must be a list of names, got {values!r}")
    return list(values)


def describe(optimizer) -> str:
    """One line: tensors and values per weight decay of ``optimizer``'s groups."""
    counts: dict[float, list[int]] = {}
    for group in optimizer.param_groups:
        tensors, values = counts.setdefault(float(group.get("weight_decay", 0.0)), [0, 0])
        counts[float(group.get("weight_decay", 0.0))] = [
            tensors + len(group["params"]), values + sum(p.numel() for p in group["params"])]
    return "; ".join(f"weight_decay {wd:g}: {t} tensors, {v:,} values"
                     for wd, (t, v) in sorted(counts.items(), reverse=True))
