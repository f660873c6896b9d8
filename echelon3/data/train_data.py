"""The data of a training run: the train loader, the validation loaders, and the check
that an epoch makes at least one optimizer step.

Validation data is ``data.val``, else the part of ``data.train`` that
``data.val_split`` sets aside, else ``data.test`` (:mod:`echelon3.data.splits`). A
validation set is loaded by ``dataloaders.<its name>`` (named sets), else
``dataloaders.val``, else ``dataloaders.test``.
"""

from __future__ import annotations

from typing import Mapping

from torch.utils.data import DataLoader

from echelon3.config.errors import BuildError, ConfigError
from echelon3.data import splits
from echelon3.data.loaders import create_dataloader, create_dataloaders


def _val_loader_name(name: str, named: bool, loaders_cfg: Mapping) -> str:
    if named and name in loaders_cfg and name not in ("train", "test"):
        return name
    for fallback in ("val", "test"):
        if fallback in loaders_cfg:
            return fallback
    raise BuildError("dataloaders.val", f"required to load validation set '{name}' (or "
                     "dataloaders.test, used when dataloaders.val is not given)")


def validation_loaders(cfg, sets: Mapping, named: bool, **common) -> dict[str, DataLoader]:
    """One loader per validation set (``common``: rank, world_size, seed, config_dir)."""
    loaders_cfg = cfg.dataloaders or {}
    if splits.selected_on(cfg.data) == splits.TEST:
        return create_dataloaders(loaders_cfg, None, sets, **common)[1]
    if cfg.data.get("val") is None:
        data_keys = dict.fromkeys(sets, splits.KEY)  # carved from data.train
    else:
        data_keys = {name: f"data.val.{name}" if named else "data.val" for name in sets}
    loaders = {}
    for name, dataset in sets.items():
        loader = _val_loader_name(name, named, loaders_cfg)
        loaders[name] = create_dataloader(loader, loaders_cfg[loader], dataset, train=False,
                                          data_key=data_keys[name], **common)
    return loaders


def train_loaders(cfg, train_set, val_sets: Mapping, named: bool, **common):
    """(train loader, {name: validation loader}); stops when an epoch would make no
    optimizer step."""
    train, _ = create_dataloaders(cfg.dataloaders, train_set, {}, **common)
    check_optimizer_steps(cfg, train_set, train, common.get("world_size", 1))
    return train, validation_loaders(cfg, val_sets, named, **common)


def check_optimizer_steps(cfg, train_set, loader: DataLoader, world_size: int) -> None:
    """A train set smaller than one global batch with ``drop_last``, or an epoch of fewer
    batches than ``grad_accum_steps``, trains nothing (or never fills a window): an error
    naming the sizes and the keys, before the run writes anything."""
    try:
        batches, samples = len(loader), len(train_set)
    except TypeError:  # an IterableDataset: its length is not known in advance
        return
    config = ((cfg.dataloaders.get("train") or {}).get("config") or {})
    batch = config.get("batch_size", 1)
    drop_last = bool(config.get("drop_last", False))
    per_rank = f" ({world_size} processes)" if world_size > 1 else ""
    if batches == 0:
        why = (f"with dataloaders.train.config.drop_last: true, data.train's {samples} samples "
               f"make no whole batch of {batch}{per_rank}") if drop_last and samples else \
            f"data.train has {samples} samples"
        raise ConfigError("dataloaders.train.config.batch_size", f"an epoch would make no "
                          f"optimizer step: {why}; lower the batch size, set drop_last: false, "
                          "or give more training data")
    trainer = (cfg.trainer.get("config") or {}) if cfg.get("trainer") is not None else {}
    accum = trainer.get("grad_accum_steps", 1)
    if isinstance(accum, int) and not isinstance(accum, bool) and batches < accum:
        raise ConfigError("trainer.config.grad_accum_steps", f"{accum} batches per optimizer "
                          f"step, but an epoch has only {batches} (data.train: {samples} "
                          f"samples, dataloaders.train.config.batch_size: {batch}{per_rank}"
                          f"{', drop_last' if drop_last else ''}), so no window is ever full; "
                          "lower grad_accum_steps or the batch size")
