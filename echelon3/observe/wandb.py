"""Weights & Biases tracking beside ``history.jsonl`` (root key ``wandb``; rank 0 only).

``wandb: true`` or ``wandb: {project, entity, mode, run_name, group, dir}``. Without
``project``: ``WANDB_PROJECT``, else the workflow's sweep (``ECHELON3_SWEEP``), else the
config's name. Without ``entity``: ``WANDB_ENTITY``, else W&B's default (the logged-in
user's). ``mode``: ``online`` (the default, or ``WANDB_MODE``) or ``offline`` (the run is
written under ``dir`` for ``wandb sync`` later). Without ``run_name``: the workflow's
experiment (``ECHELON3_EXPERIMENT``), else the name of ``target.path``. ``group``: default
the workflow's sweep. ``dir``: where wandb writes its ``wandb/`` folder; default
``WANDB_DIR``, else the folder the run starts from.

The run folder stays the source of truth: W&B gets a copy. Nothing reaches W&B before
the first record, so a run that the lock or a changed config turns away creates no W&B
run. The W&B run's id is kept in ``wandb.json`` in the run folder with the last step sent;
a resumed run continues that W&B run (``resume="allow"``) and sends no step at or below
it: W&B's steps only go up. Records of one step go as one history row. A W&B that cannot
be imported, that refuses the run or whose network fails gives one warning; the run goes
on without it and ``summary.json`` says so under ``wandb``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path

from omegaconf import OmegaConf

from echelon3 import __version__
from echelon3.checkpoints.files import atomic_write_text
from echelon3.observe.loggers import Logger, Relay, read_history
from echelon3.observe.mlflow import amend_summary, checkpoint_step
from echelon3.observe.mlflow_run import state_file
from echelon3.observe.wandb_config import Settings, check, settings

log = logging.getLogger(__name__)

STATE = "wandb.json"  # in the run folder: where the W&B run lives, and its last step
# wandb's own default waits 90 s for a server that does not answer; a run waits less.
INIT_TIMEOUT_S = 30
RECORD_KEYS = ("split", "epoch", "step")


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def rows(records: list[dict]) -> list[tuple[int, dict]]:
    """Records as W&B history rows: ``(step, {split/name: value})``, the records of one
    step (a train and a validation record, say) merged into one row, in order."""
    out: list[tuple[int, dict]] = []
    for record in records:
        step, split = int(record.get("step", 0)), record.get("split", "train")
        row = {f"{split}/{name}": float(value) for name, value in record.items()
               if name not in RECORD_KEYS and not isinstance(value, bool)
               and isinstance(value, int | float)}
        if out and out[-1][0] == step:
            out[-1][1].update(row)
        elif row:
            out.append((step, row))
    return out


class Tracker:
    """One run's W&B run (off when ``settings`` is None: the key is absent, or not rank 0).

    Every call to wandb goes through :meth:`_call`: the first failure is warned about once
    and turns tracking off for the rest of this process."""

    def __init__(self, settings: Settings | None, folder: Path, config: dict | None = None,
                 task: str = "train"):
        self.settings, self.folder, self.config, self.task = settings, Path(folder), config, task
        self.resumed = False
        self.tags: dict[str, str] = {}
        self.run = self.run_id = self.url = self.error = None
        self._floor = -1  # the last step W&B held before this attempt
        self._last: int | None = None  # the last step this attempt sent

    @property
    def on(self) -> bool:
        return self.settings is not None and self.error is None

    def _call(self, what: str, fn, *args, **kwargs):
        if not self.on:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # any refusal: the local records carry on alone
            self.error = f"{what}: {_reason(e)}"
            log.warning("W&B tracking (project %s, %s) is off for this run (%s); %s holds the "
                        "complete record", self.settings.project, self.settings.mode,
                        self.error, self.folder)
            return None

    # ------------------------------------------------------------------ the W&B run

    def ensure_run(self) -> bool:
        """Start (or continue) the W&B run on first use; True when there is one."""
        if self.run is None:
            self._call("starting the run", self._start)
        return self.on and self.run is not None

    def _start(self) -> None:
        import wandb

        s = self.settings
        known = state_file(self.folder / STATE)
        same = known is not None and known.get("project") == s.project and \
            known.get("entity") == s.entity
        if (self.resumed or self.task != "train") and same:
            run_id, self._floor = known["run_id"], int(known.get("step", -1))
        else:
            run_id = uuid.uuid4().hex[:12]
        Path(s.dir).mkdir(parents=True, exist_ok=True)
        run = wandb.init(project=s.project, entity=s.entity, name=s.run_name, group=s.group,
                         mode=s.mode, dir=s.dir, id=run_id, resume="allow", job_type=self.task,
                         settings=wandb.Settings(console="off", init_timeout=float(
                             os.environ.get("WANDB_INIT_TIMEOUT", INIT_TIMEOUT_S))))
        # online, a resumed run starts after the server's last step
        self._floor = max(self._floor, int(run.starting_step or 0) - 1)
        self.run, self.run_id, self.url = run, run.id, run.url
        if self.config is not None:  # evaluate leaves the training run's config as it is
            run.config.update({**self.config, "echelon3": {"version": __version__,
                                                           "task": self.task, **self.tags}},
                              allow_val_change=True)
        self._save()

    def _save(self) -> None:
        s = self.settings
        last = self._floor if self._last is None else max(self._floor, self._last)
        atomic_write_text(self.folder / STATE, json.dumps(
            {"project": s.project, "entity": s.entity, "mode": s.mode, "dir": s.dir,
             "run_id": self.run_id, "run_name": s.run_name, "url": self.url, "step": last},
            indent=2) + "\n")

    # ------------------------------------------------------------------ what is logged

    def log_records(self, records: list[dict]) -> None:
        """Train / validation / time records as history rows at their step. The first call
        of an attempt also sends what ``history.jsonl`` holds above W&B's last step and
        before these records (a run that trained before tracking was turned on)."""
        if self.run is None and not self.ensure_run():
            return
        if not self.on:
            return
        if self._last is None:
            first = min((int(r.get("step", 0)) for r in records), default=None)
            earlier = [r for r in read_history(self.folder / "history.jsonl")
                       if first is None or int(r.get("step", 0)) < first]
            records = earlier + records
        ahead = [(step, row) for step, row in rows(records)
                 if step > self._floor and (self._last is None or step >= self._last)]
        if not ahead:
            return
        # The step is saved before it is sent: a kill in between loses a burst rather
        # than send a step twice.
        self._last = ahead[-1][0]
        self._save()
        for step, row in ahead:
            if self._call("logging metrics", self.run.log, row, step=step) is None and \
                    not self.on:
                return

    def record(self) -> dict:
        """``summary.json``'s ``wandb`` entry (empty when tracking is off)."""
        if self.settings is None:
            return {}
        s = self.settings
        entry = {"project": s.project, "entity": s.entity, "mode": s.mode, "dir": s.dir,
                 "run_id": self.run_id, "run_name": s.run_name, "url": self.url,
                 "logged": self.error is None}
        if self.error:
            entry["error"] = self.error
        return {"wandb": entry}

    # ------------------------------------------------------------------ the end

    def watch(self, logger: Logger, resumed: bool, **tags) -> Logger:
        """``logger`` with W&B beside it (``logger`` itself when tracking is off)."""
        if self.settings is None:
            return logger
        self.resumed = resumed
        self.tags.update({k: str(v) for k, v in tags.items()})
        return WandbLogger(logger, self)

    def finish(self, summary: dict | None) -> None:
        """After ``summary.json``: the history not yet sent, the best scores in the W&B
        run's summary, ``summary.json``'s ``wandb`` entry, and the end."""
        if self.settings is None:
            return
        if self.ensure_run():
            if self._last is None:  # an attempt that trained nothing: what W&B never got
                self.log_records([])
            best = (summary or {}).get("best") or {}
            scores = {f"best/{k}": float(v) for k, v in (best.get("metrics") or {}).items()}
            if scores:
                scores["best/step"] = int(best["step"])
                self._call("writing the summary", self.run.summary.update, scores)
        amend_summary(self.folder, self.record())
        if self.run is not None:
            self._call("ending the run", self.run.finish, exit_code=0)
        if self.error:  # the end failed after the entry was written: it says so now
            amend_summary(self.folder, self.record())

    def stopped(self, error: BaseException) -> None:
        """The attempt failed or was preempted: mark the W&B run; an offline one is removed
        when the run folder was taken back (no checkpoint was ever written)."""
        if self.run is None or not self.on:
            return
        from echelon3.distributed.preemption import Preempted

        if isinstance(error, Preempted | KeyboardInterrupt):
            self._call("marking the run preempted", self.run.mark_preempting)
        files = Path(self.run.settings.sync_dir)
        self._call("ending the run", self.run.finish, exit_code=1)
        if not (self.folder / STATE).exists() and self.settings.mode == "offline":
            shutil.rmtree(files, ignore_errors=True)


class WandbLogger(Relay):
    """The run's own logger first (the source of truth), then W&B, in bursts (see
    :class:`echelon3.observe.loggers.Relay`). ``rewind`` reaches only the run's own logger:
    W&B's steps only go up, and the tracker sends no step it already sent."""


def for_task(rc, task: str = "train", folder: Path | None = None) -> Tracker:
    """The tracker of a task: off unless the ``wandb`` key is set, and on every rank but 0."""
    from echelon3.distributed.ranks import is_main

    cfg = rc.cfg
    folder = Path(folder or str(cfg.target.path))
    on = settings(cfg, getattr(rc, "config_file", None)) if is_main() else None
    config = OmegaConf.to_container(cfg, resolve=True) if on is not None and task == "train" \
        else None
    return Tracker(on, folder, config, task=task)


def log_evaluation(rc, results: dict, checkpoint: str | None) -> None:
    """``evaluate``'s metrics into the training run's summary (``test/<name>``, and
    ``test/step``: the scored checkpoint's step); a new run when training was not tracked.
    W&B's history only goes forward, so they are no history row."""
    tracker = for_task(rc, "evaluate")
    if tracker.settings is None or not tracker.ensure_run():
        return
    scores = {f"test/{k}": float(v) for k, v in results.items()
              if isinstance(v, int | float) and not isinstance(v, bool)}
    scores["test/step"] = checkpoint_step(tracker.folder, checkpoint)
    tracker._call("writing the summary", tracker.run.summary.update, scores)
    tracker._call("ending the run", tracker.run.finish, exit_code=0)


__all__ = ["STATE", "Settings", "Tracker", "WandbLogger", "check", "for_task",
           "log_evaluation", "rows", "settings"]
