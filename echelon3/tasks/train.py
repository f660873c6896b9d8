"""``echelon3 train``: assemble the run from its config, resume if possible, hand it to the trainer.

Resume: when ``target.path`` holds checkpoints the newest one that loads is
continued (network, optimizer, scheduler, scaler, epoch, step, best-so-far
metrics, RNG states). A checkpoint remembers a fingerprint of the config that
made it, ignoring keys that may change between attempts (epochs, devices,
loader workers, logging); if the fingerprint differs, root ``on_config_change``
decides: ``error`` (default) stops with exit 2, ``restart`` moves the old
files aside into ``superseded-<time>/`` and starts over, ``resume`` continues anyway.
A checkpoint also records the ``epochs`` it was trained for: another number on
resume is refused while the scheduler has a length (:mod:`echelon3.extension`).

The data is built first (:mod:`echelon3.train_data`), so a run whose epochs would
make no optimizer step stops before it writes anything; the trainer validates on
``data.val`` (or ``data.val_split``), else on ``data.test``, and each checkpoint
records which (``selected_on``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from echelon3 import __version__, build, preemption, schedulers, splits
from echelon3 import lock as run_lock
from echelon3.checkpoint import (BEST, KEPT_BEST, CheckpointManager, atomic_write_text,
                                 load_weights, training_weights)
from echelon3.config import RunConfig, changed_keys, require
from echelon3.ddp import DDP_KEYS, check_settings
from echelon3.dist import is_main, unwrap
from echelon3.errors import CheckpointError, ConfigError
from echelon3.extension import check_extend, check_extension, planned_epochs
from echelon3.finetune import WarmStart, scale_group_lrs
from echelon3.fsdp import Strategy, lockstep
from echelon3.mlops import NoOpLogger, mlflow
from echelon3.precision import Precision
from echelon3.summary import SUMMARY, finish, forget_unfinished
from echelon3.optimizers.closure import is_closure_optimizer
from echelon3.rng import seed_everything
from echelon3.sharded import SHARDED, ShardedCheckpoints, lay_out_optimizer, read_sharded
from echelon3.train_data import train_loaders

log = logging.getLogger(__name__)

# trainer.config keys used to set the run up rather than by the loop itself.
RUNTIME_KEYS = {"precision": None, "tf32": True, "cudnn_benchmark": True, "compile": False,
                "compile_mode": None, **DDP_KEYS, "extend": None}
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune",
                 "max-autotune-no-cudagraphs")
# Keys that may differ between attempts of the same run without making it another run.
VOLATILE = ("device", "gpus", "nproc", "device_ids", "mlops", "mlflow", "evaluator", "runner",
            "on_config_change", "trainer.config.epochs", "trainer.config.precision",
            "trainer.config.tf32", "trainer.config.cudnn_benchmark", "trainer.config.compile",
            "trainer.config.compile_mode", "trainer.config.log_every_n_steps",
            "trainer.config.progress_bar", "trainer.config.nan_policy", "trainer.config.profile",
            "trainer.config.extend", "strategy", "fsdp", "activation_checkpointing",
            "target.path", "target.checkpoints_to_keep", "export")
_LOADER_VOLATILE = ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory")
ON_CHANGE = ("error", "restart", "resume")


def runtime_settings(cfg) -> dict:
    given = OmegaConf.to_container(cfg.trainer.get("config") or OmegaConf.create({}))
    settings = {k: given.get(k, default) for k, default in RUNTIME_KEYS.items()}
    if settings["compile_mode"] not in COMPILE_MODES:
        raise ConfigError("trainer.config.compile_mode", f"must be one of "
                          f"{', '.join(str(m) for m in COMPILE_MODES)}; got "
                          f"{settings['compile_mode']!r}")
    for key in ("tf32", "cudnn_benchmark", "compile"):
        if not isinstance(settings[key], bool):
            raise ConfigError(f"trainer.config.{key}", f"must be true or false, got "
                              f"{settings[key]!r}")
    check_extend(settings["extend"])
    check_settings(settings)
    return settings


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


def find_resume_state(cfg, checkpoints: CheckpointManager, fp: str):
    """(path, state) of the checkpoint to continue from, or None to start fresh."""
    found = checkpoints.latest_loadable()
    if found is None:
        return None
    path, state = found
    previous = state.get("config_fingerprint")
    if previous is None or previous == fp:
        log.info("Resuming from %s (epoch %d, step %d)", path, state["epoch"],
                 state["global_step"])
        return found
    policy = cfg.get("on_config_change", "error")
    if policy not in ON_CHANGE:
        raise ConfigError("on_config_change", f"must be one of {', '.join(ON_CHANGE)}, "
                          f"got {policy!r}")
    if policy == "resume":
        log.warning("%s was made by a different config; resuming anyway (on_config_change: "
                    "resume)", path)
        return found
    if policy == "error":
        raise CheckpointError(str(checkpoints.path), "holds checkpoints of a different config"
                              f"{config_changes(cfg, state, checkpoints.path)}; use another "
                              "target.path, or set on_config_change=restart (moves them aside) "
                              "or on_config_change=resume")
    if is_main():
        aside = checkpoints.path / time.strftime("superseded-%Y%m%d-%H%M%S")
        aside.mkdir()
        for old in [*checkpoints.rolling(), checkpoints.path / BEST,
                    checkpoints.path / KEPT_BEST, checkpoints.path / "history.jsonl"]:
            if old.exists():
                shutil.move(str(old), aside / old.name)
        log.warning("config changed since %s: previous files moved to %s; starting over",
                    path, aside)
    from echelon3.dist import barrier

    barrier()
    return None


def write_run_config(cfg, path: Path) -> None:
    if not is_main():
        return
    data = OmegaConf.to_container(cfg, resolve=True)
    data["_versions"] = {"echelon3": __version__, "torch": str(torch.__version__)}
    atomic_write_text(path / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(data)))


def assemble_and_fit(rc: RunConfig, device, launcher, tracker=None):
    """Build the run, resume it if ``target.path`` allows, fit; (trainer, epochs done
    before this attempt). ``tracker``: the run's MLflow tracker, if any."""
    cfg = rc.cfg
    require(cfg, "net", "data", "dataloaders", "loss", "optimizer", "trainer", "target",
            task="train")
    settings = runtime_settings(cfg)
    strategy = Strategy(cfg, settings, device)
    preemption.install()
    seed = int(cfg.get("seed", 0))
    seed_everything(seed)
    checkpoints = ShardedCheckpoints.like(build.build_target(cfg, rc.config_dir),
                                          sharded=strategy.sharded)
    checkpoints.remove_leftovers()
    warm = WarmStart(cfg, rc.config_dir)
    net = build.build_net(cfg, rc.config_dir)
    params = warm.apply(net)  # frozen parameters: out of the optimizer and of DDP
    warm.record(cfg)  # the source weights' hash joins the run's identity
    # The data before any file is touched: a run that cannot train stops here.
    train_set, val_sets, named = build.build_datasets(cfg, rc.config_dir)
    train_loader, val_loaders = train_loaders(
        cfg, train_set, val_sets, named, rank=launcher.rank, world_size=launcher.world_size,
        seed=seed, config_dir=rc.config_dir)
    fp = fingerprint(cfg)
    path, state = find_resume_state(cfg, checkpoints, fp) or (None, None)
    if state is not None:
        check_extension(cfg, state, settings["extend"])
        if SHARDED not in state:  # a sharded one is read once the network is wrapped
            # With EMA, training goes on from the training weights, not the average.
            load_weights(net, training_weights(state), path)
    else:
        warm.load(net)
    net.to(device)
    losses = build.build_losses(cfg, rc.config_dir, device=device)
    metrics = build.build_metrics(cfg, rc.config_dir, device=device)
    params = strategy.prepare(net, params, device, launcher.world_size, settings)
    optimizer = build.build_optimizer(cfg, params, rc.config_dir)
    scale_group_lrs(optimizer)
    scheduler = schedulers.build(cfg, optimizer, rc.config_dir,
                                 steps_per_epoch=steps_per_epoch(cfg, train_loader),
                                 epochs=planned_epochs(cfg))
    precision = Precision.from_config(device, settings["precision"], settings["tf32"],
                                      settings["cudnn_benchmark"],
                                      closure=is_closure_optimizer(optimizer))
    log.info("training on %s x%d, precision %s%s", device, launcher.world_size,
             precision.describe(), ", compiled" if settings["compile"] else "")
    profiling = bool((cfg.trainer.get("config") or {}).get("profile"))
    model = strategy.wrap(net, device, launcher.world_size, settings, profiling)
    checkpoints.attach(model, optimizer)
    if state is not None and SHARDED in state:
        read_sharded(state, model, optimizer)
        load_weights(unwrap(model), training_weights(state), path)
    elif state is not None:
        lay_out_optimizer(state, model, optimizer)
    if strategy.sharded and launcher.world_size > 1:
        val_loaders = lockstep(val_loaders, model, precision, device)
    # Same initial weights everywhere (seeded above); from here each rank draws its own
    # dropout masks and augmentations.
    seed_everything(seed + launcher.rank)

    if is_main():
        (checkpoints.path / SUMMARY).unlink(missing_ok=True)  # written again when done
    write_run_config(cfg, checkpoints.path)
    logger = build.build_mlops(cfg, str(checkpoints.path), rc.config_dir) if is_main() \
        else NoOpLogger()
    if tracker is not None:  # MLflow beside the logger; its run starts with the first record
        logger = tracker.watch(logger, resumed=state is not None,
                               world_size=launcher.world_size, precision=precision.describe())
    # The trainer validates on the validation sets (data.val, data.val_split, else data.test).
    trainer = build.build_trainer(
        cfg, rc.config_dir, runtime_keys=RUNTIME_KEYS, net=model, losses=losses,
        optimizer=optimizer, scheduler=scheduler, train_loader=train_loader,
        test_loaders=val_loaders, metrics=metrics, checkpoints=checkpoints, logger=logger,
        precision=precision, device=device, named_sets=named, resume_state=state,
        scheduler_interval=schedulers.interval(cfg),
        extra_state=run_record(cfg, fp))
    try:
        trainer.fit()
    finally:
        logger.close()
    return trainer, int(state["epoch"]) if state is not None else 0


def steps_per_epoch(cfg, train_loader) -> int:
    """Optimizer steps in one epoch on one rank (accumulation windows)."""
    accum = int(((cfg.trainer.get("config") or {}).get("grad_accum_steps")) or 1)
    return -(-len(train_loader) // max(accum, 1))


def run_record(cfg, fp: str) -> dict:
    """What every checkpoint of this attempt records about the run besides its state."""
    return {"config_fingerprint": fp,
            "run_identity": json.dumps(identity(OmegaConf.to_container(cfg, resolve=True)),
                                       default=str),
            "epochs": planned_epochs(cfg),  # compared on resume (echelon3.extension)
            "selected_on": splits.selected_on(cfg.data)}


def train(rc: RunConfig, device, launcher) -> None:
    with run_lock.for_worker(rc.cfg):
        _train(rc, device, launcher)


def _train(rc: RunConfig, device, launcher) -> None:
    """Assemble and fit; close with a summary, or take back a run folder that never
    reached its first checkpoint."""
    started = time.time()
    folder = build.build_target(rc.cfg, rc.config_dir).path
    tracker = mlflow.for_task(rc)
    try:
        trainer, before = assemble_and_fit(rc, device, launcher, tracker)
    except BaseException as e:
        forget_unfinished(folder, started)
        tracker.stopped(e)
        raise
    summary = finish(folder, getattr(trainer, "epoch", 0), started, before=before,
                     stopped=trainer.stopped_early() if hasattr(trainer, "stopped_early")
                     else None)
    tracker.finish(summary)  # summary.json gets its `mlflow` entry; the files go to MLflow
