"""What makes a run the same run: the config fingerprint, and what a changed config does.

A checkpoint remembers a fingerprint of the config that made it, ignoring keys that may
change between attempts (:data:`VOLATILE`: epochs, devices, loader workers, logging). On
resume a different fingerprint is settled by root ``on_config_change``: ``error`` (the
default) stops with exit 2 and the changed keys, ``restart`` moves the old files aside
into ``superseded-<time>/`` and starts over, ``resume`` continues anyway.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from echelon3 import __version__
from echelon3.checkpoints.extension import planned_epochs, planned_max_steps
from echelon3.checkpoints import aside
from echelon3.checkpoints.files import BEST, KEPT_BEST, CheckpointManager, atomic_write_text
from echelon3.config.compose import changed_keys
from echelon3.config.errors import CheckpointError, ConfigError
from echelon3.data import splits
from echelon3.distributed.ranks import barrier, is_main

log = logging.getLogger(__name__)

# Keys that may differ between attempts of the same run without making it another run.
VOLATILE = ("device", "gpus", "nproc", "device_ids", "mlops", "mlflow", "wandb", "evaluator",
            "runner", "on_config_change", "trainer.config.epochs", "trainer.config.precision",
            "trainer.config.tf32", "trainer.config.cudnn_benchmark", "trainer.config.compile",
            "trainer.config.compile_mode", "trainer.config.log_every_n_steps",
            "trainer.config.progress_bar", "trainer.config.gc_every_n_steps",
            "trainer.config.nan_policy", "trainer.config.profile", "trainer.config.extend",
            "trainer.config.max_steps", "strategy", "fsdp", "activation_checkpointing",
            "target.path", "target.checkpoints_to_keep",
            "target.every_n_steps", "target.every_n_minutes", "target.step_checkpoints_to_keep",
            "target.async_save", "resume_from", "export")
_LOADER_VOLATILE = ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory")
ON_CHANGE = ("error", "restart", "resume")



def identity(data: dict) -> dict:
    """What defines the run, from the resolved config (see VOLATILE for what does not)."""
    data = json.loads(json.dumps(data, default=str))
    for dotted in VOLATILE:
        *parents, last = dotted.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    for loader in (data.get("dataloaders") or {}).values():
        for key in _LOADER_VOLATILE:
            ((loader or {}).get("config") or {}).pop(key, None)
    return {k: v for k, v in data.items() if not str(k).startswith("_")}


def fingerprint(cfg) -> str:
    """A hash of :func:`identity`."""
    data = identity(OmegaConf.to_container(cfg, resolve=True))
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_changes(cfg, state: dict, folder: Path) -> str:
    """``key: old -> new, ...`` between the checkpoint's config (or the folder's
    config.yaml, for checkpoints older than that record) and this one."""
    if "run_identity" in state:
        old = json.loads(state["run_identity"])
    elif (folder / "config.yaml").is_file():
        old = identity(OmegaConf.to_container(OmegaConf.load(folder / "config.yaml")))
    else:
        return ""
    changes = changed_keys(old, identity(OmegaConf.to_container(cfg, resolve=True)))
    return f" ({'; '.join(changes)})" if changes else ""


def chosen_checkpoint(cfg, checkpoints: CheckpointManager) -> Path | None:
    """The checkpoint root ``resume_from`` names (a path, or a name in ``target.path``), or
    None; a name that is not one of the run's rolling checkpoints is refused."""
    chosen = cfg.get("resume_from")
    if not chosen:
        return None
    path = Path(str(chosen))
    if not path.exists() and (checkpoints.path / path).exists():
        path = checkpoints.path / path
    rolling = {p.resolve(): p for p in checkpoints.rolling()}
    if path.resolve() not in rolling:
        names = ", ".join(p.name for p in checkpoints.rolling()) or "none"
        raise ConfigError("resume_from", f"{chosen} is not a checkpoint of this run's "
                          f"target.path {checkpoints.path} (its checkpoints: {names}); to "
                          "start another run from its weights use init_from")
    return rolling[path.resolve()]


def _take_chosen(checkpoints: CheckpointManager, path: Path):
    """Load the chosen checkpoint and set the later ones aside (rank 0 moves them)."""
    state = checkpoints.load(path)
    if is_main():
        best = checkpoints.path / KEPT_BEST
        best_step = int(torch.load(best, map_location="cpu", weights_only=True, mmap=True)
                        ["global_step"]) if best.is_file() else None
        aside.set_aside(checkpoints.path, checkpoints.rolling(), path, best_step,
                        int(state["global_step"]))
    barrier()
    return path, state


def find_resume_state(cfg, checkpoints: CheckpointManager, fp: str):
    """(path, state) of the checkpoint to continue from (root ``resume_from``, else the
    newest that loads), or None to start fresh."""
    chosen = chosen_checkpoint(cfg, checkpoints)
    found = checkpoints.latest_loadable() if chosen is None else (chosen, None)
    if found is None:
        return None
    path, state = found
    if state is None:
        state = checkpoints.load(path)
    previous = state.get("config_fingerprint")
    if previous is None or previous == fp:
        log.info("Resuming from %s (epoch %d, step %d)", path, state["epoch"],
                 state["global_step"])
        return _take_chosen(checkpoints, path) if chosen is not None else (path, state)
    policy = cfg.get("on_config_change", "error")
    if policy not in ON_CHANGE:
        raise ConfigError("on_config_change", f"must be one of {', '.join(ON_CHANGE)}, "
                          f"got {policy!r}")
    if policy == "resume":
        log.warning("%s was made by a different config; resuming anyway (on_config_change: "
                    "resume)", path)
        return _take_chosen(checkpoints, path) if chosen is not None else (path, state)
    if policy == "error":
        raise _changed(cfg, state, checkpoints.path)
    if is_main():
        aside = checkpoints.path / time.strftime("superseded-%Y%m%d-%H%M%S")
        aside.mkdir()
        for old in [*checkpoints.rolling(), checkpoints.path / BEST,
                    checkpoints.path / KEPT_BEST, checkpoints.path / "history.jsonl"]:
            if old.exists():
                shutil.move(str(old), aside / old.name)
        log.warning("config changed since %s: previous files moved to %s; starting over",
                    path, aside)
    barrier()
    return None


def write_run_config(cfg, path: Path) -> None:
    if not is_main():
        return
    data = OmegaConf.to_container(cfg, resolve=True)
    data["_versions"] = {"echelon3": __version__, "torch": str(torch.__version__)}
    atomic_write_text(path / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(data)))


def run_record(cfg, fp: str, split: tuple | None = None) -> dict:
    """What every checkpoint of this attempt records about the run besides its state;
    ``split``: the (fraction, seed) its validation set was carved with."""
    return {"config_fingerprint": fp,
            "run_identity": json.dumps(identity(OmegaConf.to_container(cfg, resolve=True)),
                                       default=str),
            # compared on resume (echelon3.checkpoints.extension)
            "epochs": planned_epochs(cfg), "max_steps": planned_max_steps(cfg),
            "selected_on": splits.selected_on(cfg.data),
            splits.RECORD: splits.record(cfg.data, split)}


def _changed(cfg, state: dict, folder: Path) -> CheckpointError:
    return CheckpointError(str(folder), "holds checkpoints of a different config"
                           f"{config_changes(cfg, state, folder)}; use another target.path, "
                           "or set on_config_change=restart (moves them aside) or "
                           "on_config_change=resume")


def _state_without_tensors(path: Path) -> dict | None:
    """A rolling checkpoint's state, its tensors memory-mapped (None: it does not load,
    which the worker's own reading names)."""
    source = path / "state.pt" if path.is_dir() else path
    try:
        state = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    return state if isinstance(state, dict) else None


def refuse_changed_config(cfg, config_dir: Path | None) -> None:
    """In the launcher, before any worker starts: the refusal a changed config gets under
    ``on_config_change: error`` (the default), found as the worker would find it."""
    from echelon3.checkpoints.sharded import ShardedCheckpoints
    from echelon3.tasks import components
    from echelon3.tasks.finetune import WarmStart

    if cfg.get("on_config_change", "error") != "error" or not cfg.get("target"):
        return
    from echelon3.config.compose import require

    require(cfg, "net", "data", "dataloaders", "loss", "optimizer", "trainer", "target",
            task="train")  # a missing section is said as such first, as by the task
    checkpoints = ShardedCheckpoints.like(components.build_target(cfg, config_dir), False)
    chosen = chosen_checkpoint(cfg, checkpoints)
    for path in [chosen] if chosen else checkpoints.rolling():  # the one a resume would take
        state = _state_without_tensors(path)
        if state is None:
            continue
        if state.get("config_fingerprint") is None:
            return  # from before fingerprints: taken as it is
        probe = copy.deepcopy(cfg)
        WarmStart(probe, config_dir).record(probe)  # init_from's weights join the identity
        if state["config_fingerprint"] != fingerprint(probe):
            raise _changed(probe, state, checkpoints.path)
        return
