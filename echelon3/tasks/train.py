"""``echelon3 train``: assemble the run from its config, resume if possible, hand it to the trainer.

Resume: when ``target.path`` holds checkpoints the newest one that loads is
continued (network, optimizer, scheduler, scaler, epoch, step, best-so-far
metrics, RNG states). A checkpoint remembers a fingerprint of the config that
made it; if the fingerprint differs, root ``on_config_change`` decides
(:mod:`echelon3.tasks.identity`).
A checkpoint also records the ``epochs`` it was trained for: another number on
resume is refused while the scheduler has a length (:mod:`echelon3.checkpoints.extension`).

The data is built first (:mod:`echelon3.data.train_data`), so a run whose epochs would
make no optimizer step stops before it writes anything; the trainer validates on
``data.val`` (or ``data.val_split``), else on ``data.test``, and each checkpoint
records which (``selected_on``).
"""

from __future__ import annotations

import logging
import time

from omegaconf import OmegaConf

from echelon3.checkpoints import lock as run_lock
from echelon3.checkpoints.extension import (check_extend, check_extension, planned_epochs,
                                            planned_max_steps)
from echelon3.checkpoints.files import load_weights, training_weights
from echelon3.checkpoints.optimizer_layout import lay_out_optimizer
from echelon3.checkpoints.sharded import SHARDED, ShardedCheckpoints, read_sharded
from echelon3.config.compose import RunConfig, require
from echelon3.config.derived import after_data
from echelon3.config.errors import ConfigError
from echelon3.data.rng import seed_everything
from echelon3.data.loaders import known_length, limit_batches
from echelon3.data.train_data import train_loaders
from echelon3.distributed import preemption
from echelon3.distributed.ddp import DDP_KEYS, check_settings
from echelon3.distributed.fsdp import Strategy, lockstep
from echelon3.distributed.precision import Precision
from echelon3.distributed.ranks import is_main, unwrap
from echelon3.observe import trackers
from echelon3.observe.loggers import NoOpLogger
from echelon3.optimizers.closure import is_closure_optimizer
from echelon3.tasks import components
from echelon3.tasks.finetune import WarmStart, scale_group_lrs
from echelon3.tasks.identity import find_resume_state, fingerprint, run_record, write_run_config
from echelon3.tasks.summary import SUMMARY, finish, forget_unfinished
from echelon3.trainers import schedulers

log = logging.getLogger(__name__)

# trainer.config keys used to set the run up rather than by the loop itself.
RUNTIME_KEYS = {"precision": None, "tf32": True, "cudnn_benchmark": True, "compile": False,
                "compile_mode": None, **DDP_KEYS, "extend": None, "limit_val_batches": None}
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune",
                 "max-autotune-no-cudagraphs")
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
    limit = settings["limit_val_batches"]
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError("trainer.config.limit_val_batches", f"must be an integer >= 1 or "
                          f"null, got {limit!r}")
    check_settings(settings)
    return settings


def assemble_and_fit(rc: RunConfig, device, launcher, tracker=None):
    """Build the run, resume it if ``target.path`` allows, fit; (trainer, epochs done
    before this attempt). ``tracker``: the run's trackers (MLflow, W&B), if any."""
    cfg = rc.cfg
    require(cfg, "net", "data", "dataloaders", "loss", "optimizer", "trainer", "target",
            task="train")
    settings = runtime_settings(cfg)
    strategy = Strategy(cfg, settings, device)
    preemption.install()
    seed = int(cfg.get("seed", 0))
    seed_everything(seed)
    checkpoints = ShardedCheckpoints.like(components.build_target(cfg, rc.config_dir),
                                          sharded=strategy.sharded)
    checkpoints.remove_leftovers()
    warm = WarmStart(cfg, rc.config_dir)
    net = components.build_net(cfg, rc.config_dir)
    params = warm.apply(net)  # frozen parameters: out of the optimizer and of DDP
    warm.record(cfg)  # the source weights' hash joins the run's identity
    # The data before any file is touched: a run that cannot train stops here.
    split = warm.split(cfg.data, seed)  # a fine-tuned run validates on its parent's unseen
    train_set, val_sets, named = components.build_datasets(cfg, rc.config_dir, split=split)
    train_loader, val_loaders = train_loaders(
        cfg, train_set, val_sets, named, rank=launcher.rank, world_size=launcher.world_size,
        seed=seed, config_dir=rc.config_dir)
    fp = fingerprint(cfg)  # ${calc:...} over the data's facts count as written
    path, state = find_resume_state(cfg, checkpoints, fp) or (None, None)
    if state is not None:
        check_extension(cfg, state, settings["extend"])
        if SHARDED not in state:  # a sharded one is read once the network is wrapped
            # With EMA, training goes on from the training weights, not the average.
            load_weights(net, training_weights(state), path)
    else:
        warm.load(net)
    net.to(device)
    identity_cfg, cfg = cfg, after_data(cfg, launcher.world_size,
                                        steps_per_epoch(cfg, train_loader))
    losses = components.build_losses(cfg, rc.config_dir, device=device)
    metrics = components.build_metrics(cfg, rc.config_dir, device=device)
    params = strategy.prepare(net, params, device, launcher.world_size, settings)
    optimizer = components.build_optimizer(cfg, params, rc.config_dir, net=net)
    scale_group_lrs(optimizer)
    scheduler = schedulers.build(cfg, optimizer, rc.config_dir,
                                 steps_per_epoch=steps_per_epoch(cfg, train_loader),
                                 epochs=planned_epochs(cfg), max_steps=planned_max_steps(cfg))
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
    val_loaders = limit_batches(val_loaders, settings["limit_val_batches"])
    if strategy.sharded and launcher.world_size > 1:
        val_loaders = lockstep(val_loaders, model, precision, device)
    # Same initial weights everywhere (seeded above); from here each rank draws its own
    # dropout masks and augmentations.
    seed_everything(seed + launcher.rank)

    if is_main():
        (checkpoints.path / SUMMARY).unlink(missing_ok=True)  # written again when done
    write_run_config(cfg, checkpoints.path)
    logger = components.build_mlops(cfg, str(checkpoints.path), rc.config_dir) if is_main() \
        else NoOpLogger()
    if tracker is not None:  # trackers beside the logger; their runs start with the first record
        logger = tracker.watch(logger, resumed=state is not None,
                               world_size=launcher.world_size, precision=precision.describe())
    # The trainer validates on the validation sets (data.val, data.val_split, else data.test).
    trainer = components.build_trainer(
        cfg, rc.config_dir, runtime_keys=RUNTIME_KEYS, net=model, losses=losses,
        optimizer=optimizer, scheduler=scheduler, train_loader=train_loader,
        test_loaders=val_loaders, metrics=metrics, checkpoints=checkpoints, logger=logger,
        precision=precision, device=device, named_sets=named, resume_state=state,
        scheduler_interval=schedulers.interval(cfg),
        extra_state=run_record(identity_cfg, fp, split))
    trainer.resumed_from = path  # said in the summary
    try:
        try:
            trainer.fit()
        except BaseException:
            checkpoints.wait(alone=True)  # a background write finishes; the error goes on
            raise
        checkpoints.wait()  # the last checkpoint is complete before the summary
    finally:
        logger.close()
    return trainer, (int(state["epoch"]), int(state["global_step"])) if state is not None \
        else (0, 0)


def steps_per_epoch(cfg, train_loader) -> int | None:
    """Optimizer steps in one epoch on one rank (accumulation windows); None for a stream
    of unknown length."""
    accum = int(((cfg.trainer.get("config") or {}).get("grad_accum_steps")) or 1)
    batches = known_length(train_loader)
    return None if batches is None else -(-batches // max(accum, 1))


def train(rc: RunConfig, device, launcher) -> None:
    with run_lock.for_worker(rc.cfg):
        _train(rc, device, launcher)


def _train(rc: RunConfig, device, launcher) -> None:
    """Assemble and fit; close with a summary, or take back a run folder that never
    reached its first checkpoint."""
    started = time.time()
    folder = components.build_target(rc.cfg, rc.config_dir).path
    tracker = trackers.for_task(rc)
    try:
        trainer, before = assemble_and_fit(rc, device, launcher, tracker)
    except BaseException as e:
        forget_unfinished(folder, started)
        tracker.stopped(e)
        raise
    summary = finish(folder, getattr(trainer, "epoch", 0), started, before=before,
                     stopped=trainer.stopped_early() if hasattr(trainer, "stopped_early")
                     else None, steps=getattr(trainer, "global_step", None),
                     max_steps=planned_max_steps(rc.cfg),
                     resumed_from=getattr(trainer, "resumed_from", None),
                     throughput=trainer.throughput.summary()
                     if hasattr(trainer, "throughput") else None)
    tracker.finish(summary)  # summary.json gets `mlflow` / `wandb` entries; files to MLflow


def finetune(rc: RunConfig, device, launcher) -> None:
    """``echelon3 finetune``: ``train`` started from ``init_from``'s weights (required here)."""
    require(rc.cfg, "init_from", task="finetune")
    train(rc, device, launcher)
