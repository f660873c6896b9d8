"""What the launcher settles itself, before any worker starts or any data is built.

Three answers need only the config and the run folder, so no worker is started for them:

- ``train`` / ``finetune`` of a config that changed since the run's checkpoints, under
  ``on_config_change: error`` (the default): refused, exit 2 (:func:`refuse`);
- ``evaluate`` / ``run`` of a run that has no checkpoint, with the built-in evaluator or
  runner and no ``checkpoint`` named: refused, exit 2 (:func:`refuse`);
- ``train`` / ``finetune`` of a finished run, whose newest checkpoint is already at the
  planned length (``trainer.config.epochs`` or ``max_steps``): nothing to train. The
  launcher says so and writes ``config.yaml`` and ``summary.json`` again, as a worker
  would have (:func:`finished`).

Each says what the worker would have said, with the same exit code. Only the run's
checkpoint metadata is read (memory-mapped: its tensors stay on disk). Anything less plain
(a trainer or logger of one's own, MLflow on, early stopping, ``resume_from``, FSDP, a job that
torchrun or ``srun`` started, a checkpoint that does not load) is left to the workers as
before: they find the same answer, after building the run.
"""

from __future__ import annotations

import copy
import logging
import time

from echelon3.config.compose import RunConfig, require
from echelon3.distributed.launch import detect_launcher

log = logging.getLogger(__name__)

TRAINING = ("train", "finetune")
# The built-in section each inference task reads its checkpoint through.
INFERENCE = {"evaluate": ("evaluator", "echelon3.tasks.evaluate", "Evaluator"),
             "run": ("runner", "echelon3.tasks.run", "Runner")}
TRAINER = ("echelon3.trainers.baseline", "Trainer")
LOGGER = ("echelon3.observe.loggers", "DefaultLogger")  # history.jsonl (+ TensorBoard)
LENGTH_KEYS = ("epochs", "max_steps", "val_check_interval", "validate_at_start",
               "times_to_validate_per_epoch")


def launched_here() -> bool:
    """This process starts the workers itself (no torchrun / ``srun`` around it): every
    answer here is then given once, by one process."""
    return detect_launcher().kind == "none"


def refuse(command: str, rc: RunConfig) -> None:
    """Raise the refusal a worker would make that the launcher can see (else nothing)."""
    if command in TRAINING:
        from echelon3.tasks.identity import refuse_changed_config

        refuse_changed_config(rc.cfg, rc.config_dir)
    elif command in INFERENCE:
        _refuse_without_checkpoint(command, rc)


def _built_in(cfg, key: str, module: str, type_: str) -> dict | None:
    """The settings of section ``key`` when it is the built-in ``module.type``, else None."""
    from echelon3.config.build import with_default_type

    try:
        spec = with_default_type(cfg.get(key), key, module, type_)
    except Exception:
        return None  # a malformed section: the task names it
    if (spec.get("module"), spec.get("type")) != (module, type_):
        return None
    return spec.get("config") or {}


def _refuse_without_checkpoint(command: str, rc: RunConfig) -> None:
    from echelon3.tasks import components

    key, module, type_ = INFERENCE[command]
    settings = _built_in(rc.cfg, key, module, type_)
    if settings is None or settings.get("checkpoint"):
        return  # its own class, or a named file: the worker reads it
    require(rc.cfg, "net", "dataloaders", "target", task=command)  # said first, as by the task
    components.build_target(rc.cfg, rc.config_dir).for_inference(None)


def finished(command: str, rc: RunConfig) -> bool:
    """For a finished run: say that nothing is left to train, write the summary again
    (rank 0's files, as the worker would) -> True. False: the workers decide."""
    if command not in TRAINING or not _plain(rc):
        return False
    try:
        found = _finished_point(rc)
    except Exception:  # whatever it is, a worker says it as it always has
        return False
    if found is None:
        return False
    _close(rc, *found)
    return True


def _plain(rc: RunConfig) -> bool:
    """A run whose end the launcher can tell from its checkpoint alone."""
    from echelon3.observe.mlflow_config import settings as mlflow_settings
    from echelon3.observe.wandb_config import settings as wandb_settings

    cfg = rc.cfg
    trainer = _built_in(cfg, "trainer", *TRAINER)
    logger = _built_in(cfg, "mlops", *LOGGER)
    return (trainer is not None and logger is not None and not trainer.get("early_stopping")
            and not cfg.get("resume_from") and str(cfg.get("strategy") or "ddp") == "ddp"
            and mlflow_settings(cfg, rc.config_file) is None
            and wandb_settings(cfg, rc.config_file) is None)


def _finished_point(rc: RunConfig):
    """(checkpoint manager, newest checkpoint, its state, why nothing is left) of a
    finished run, or None."""
    from echelon3.checkpoints.extension import check_extension
    from echelon3.tasks import components
    from echelon3.tasks.finetune import WarmStart
    from echelon3.tasks.identity import _state_without_tensors, fingerprint
    from echelon3.tasks.train import runtime_settings
    from echelon3.trainers.length import RunLength

    cfg = rc.cfg
    checkpoints = components.build_target(cfg, rc.config_dir)
    newest = next(iter(checkpoints.rolling()), None)
    state = None if newest is None else _state_without_tensors(newest)
    if state is None or "model_state_dict" not in state:
        return None
    probe = copy.deepcopy(cfg)
    WarmStart(probe, rc.config_dir).record(probe)  # init_from's weights join the identity
    if state.get("config_fingerprint") not in (None, fingerprint(probe)):
        return None
    check_extension(cfg, state, runtime_settings(cfg)["extend"])
    given = _built_in(cfg, "trainer", *TRAINER)
    length = RunLength(**{k: given[k] for k in LENGTH_KEYS if k in given})
    why = length.finished(int(state["epoch"]), int(state["global_step"]))
    return None if why is None else (checkpoints, newest, state, why)


def _close(rc: RunConfig, checkpoints, path, state: dict, why: str) -> None:
    """What the worker's train task logs and writes for a run with nothing left."""
    from echelon3.checkpoints.extension import planned_max_steps
    from echelon3.observe.loggers import JsonlLogger
    from echelon3.tasks.identity import write_run_config
    from echelon3.tasks.summary import finish

    started = time.time()
    epoch, step = int(state["epoch"]), int(state["global_step"])
    log.info("Resuming from %s (epoch %d, step %d)", path, epoch, step)
    checkpoints.remove_leftovers()
    log.info("nothing to train: %s", why)
    write_run_config(rc.cfg, checkpoints.path)
    # records an attempt that died after the newest checkpoint wrote, as the worker's
    # logger drops them (TensorBoard hides them at its next write: there is none)
    JsonlLogger(checkpoints.path / "history.jsonl").rewind(step)
    checkpoints.ensure_best()
    finish(checkpoints.path, epoch, started, before=(epoch, step), steps=step,
           max_steps=planned_max_steps(rc.cfg), resumed_from=path)
