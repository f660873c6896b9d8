"""MLflow tracking beside ``history.jsonl`` (root key ``mlflow``; rank 0 only).

``mlflow: true`` or ``mlflow: {tracking_uri, experiment, run_name, log_models}``.
Without ``tracking_uri``, ``MLFLOW_TRACKING_URI`` is used, else the local store
that ``mlflow ui`` opens in the working directory (``mlflow.db``, or ``./mlruns``
where such a store already exists). Without ``experiment``: ``MLFLOW_EXPERIMENT_NAME``,
else the workflow's sweep (``ECHELON3_SWEEP``), else the config's name. Without
``run_name``: the workflow's experiment (``ECHELON3_EXPERIMENT``), else the name of
``target.path``.

The run folder stays the source of truth: MLflow gets a copy. Nothing reaches
MLflow before the first record, so a run that the lock or a changed config turns
away creates no MLflow run. The MLflow run's id is kept in ``mlflow.json`` in the
run folder; a resumed run continues that MLflow run and sends no step that MLflow
already holds for a metric (it cannot delete points). A tracking server that is
down or refuses gives one warning; the run goes on without it and ``summary.json``
says so under ``mlflow``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from omegaconf import OmegaConf

from echelon3.checkpoints.files import atomic_write_text
from echelon3.observe.loggers import Logger, Relay, read_history
from echelon3.observe.mlflow_config import Settings, check, settings
from echelon3.observe.mlflow_run import flatten, metric_key, run_tags, run_url, state_file

log = logging.getLogger(__name__)

STATE = "mlflow.json"  # in the run folder: where the MLflow run lives
# MLflow's own defaults retry a refused connection for minutes; a run waits far less.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
BATCH = 1000  # MLflow's limit of metrics per log_batch


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


class Tracker:
    """One run's MLflow run (off when ``settings`` is None: the key is absent, or not rank 0).

    Every call to MLflow goes through :meth:`_call`: the first failure is warned about
    once and turns tracking off for the rest of this process."""

    def __init__(self, settings: Settings | None, folder: Path, config: dict | None = None,
                 task: str = "train"):
        self.settings, self.folder, self.config, self.task = settings, Path(folder), config, task
        self.resumed = False
        self.started = int(time.time() * 1000)  # the MLflow run's start (not its first record's)
        self.tags: dict[str, str] = {}
        self.run_id = self.experiment_id = self.error = None
        self._client = None
        self._before: dict[str, int] = {}  # metric -> last step MLflow held before this attempt
        self._first: dict[str, int] = {}  # metric -> first step this attempt sent

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
            log.warning("MLflow tracking at %s is off for this run (%s); %s holds the "
                        "complete record", self.settings.tracking_uri, self.error, self.folder)
            return None

    # ------------------------------------------------------------------ the MLflow run

    def ensure_run(self) -> bool:
        """Create (or find again) the MLflow run on first use; True when there is one."""
        if self.run_id is None:
            self._call("starting the run", self._start)
        return self.on and self.run_id is not None

    def _start(self) -> None:
        from mlflow import MlflowClient

        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        client = MlflowClient(tracking_uri=self.settings.tracking_uri)
        known = state_file(self.folder / STATE)
        run = None
        if (self.resumed or self.task != "train") and known and \
                known.get("tracking_uri") == self.settings.tracking_uri:
            run = self._find(client, known["run_id"])
        if run is None:
            run = self._create(client)
            tags = run_tags(self.task, self.tags)
        else:
            self._before = self._last_steps(client, run)
            tags = {}  # evaluate or export, into the training run: its tags stay the training's
            if self.task == "train":
                client.update_run(run.info.run_id, status="RUNNING")
                tags = run_tags(self.task, self.tags)
        self._client, self.run_id = client, run.info.run_id
        self.experiment_id = run.info.experiment_id
        self._log_params(client, set(run.data.params), tags)

    @staticmethod
    def _find(client, run_id: str):
        """The run ``mlflow.json`` names, or None when the store no longer has it."""
        from mlflow.exceptions import MlflowException

        try:
            run = client.get_run(run_id)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            return None
        return run if run.info.lifecycle_stage == "active" else None

    def _create(self, client):
        name = self.settings.experiment
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                experiment_id = client.create_experiment(name)
            except Exception:  # another job of the sweep created it first
                experiment = client.get_experiment_by_name(name)
                if experiment is None:
                    raise
                experiment_id = experiment.experiment_id
        else:
            experiment_id = experiment.experiment_id
        run = client.create_run(experiment_id, start_time=self.started,
                                run_name=self.settings.run_name)
        atomic_write_text(self.folder / STATE, json.dumps(
            {"tracking_uri": self.settings.tracking_uri, "experiment": name,
             "experiment_id": experiment_id, "run_id": run.info.run_id,
             "run_name": self.settings.run_name}, indent=2) + "\n")
        return run

    @staticmethod
    def _last_steps(client, run) -> dict[str, int]:
        return {key: max(m.step for m in client.get_metric_history(run.info.run_id, key))
                for key in run.data.metrics}

    def _log_params(self, client, present: set[str], tags: dict[str, str]) -> None:
        """The tags, and the resolved config flattened; a parameter MLflow already holds is
        not sent again (MLflow keeps a run's first value of a parameter)."""
        from mlflow.entities import Param, RunTag

        config = flatten(self.config) if self.config is not None else {}
        params = [Param(k, v) for k, v in config.items() if k not in present]
        client.log_batch(self.run_id, params=params[:100],
                         tags=[RunTag(k, v) for k, v in tags.items()])
        for i in range(100, len(params), 100):  # MLflow's limit of params per batch
            client.log_batch(self.run_id, params=params[i:i + 100])

    # ------------------------------------------------------------------ what is logged

    def log_records(self, records: list[dict], backfill: bool = False) -> None:
        """Train / validation / time records as metrics ``split/name`` at their step."""
        if not records or not self.ensure_run():
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        # records a millisecond apart: two equal records stay two points in MLflow's store
        for i, record in enumerate(records):
            step, split = int(record.get("step", 0)), record.get("split", "train")
            for name, value in record.items():
                if name in ("split", "epoch", "step") or isinstance(value, bool) or \
                        not isinstance(value, int | float):
                    continue
                metrics.append(Metric(metric_key(f"{split}/{name}"), float(value), now + i,
                                      step))
        self.log_metrics(metrics, backfill)

    def backfill(self) -> None:
        """The records of ``history.jsonl`` that MLflow never got: tracking turned on for a
        run that had trained without it (a finished run trains nothing, so this attempt
        sends no record of its own), or before this attempt's first record."""
        self.log_records(read_history(self.folder / "history.jsonl"), backfill=True)

    def log_metrics(self, metrics: list, backfill: bool = False) -> None:
        """``metrics``, less the points at or before the last step MLflow held for their
        metric when this attempt began (sent by an earlier attempt); ``backfill``: also
        less those at or after the first step this attempt sent."""
        metrics = [m for m in metrics if m.step > self._before.get(m.key, -1)]
        if backfill:
            metrics = [m for m in metrics if m.step < self._first.get(m.key, m.step + 1)]
        else:
            for m in metrics:
                self._first.setdefault(m.key, m.step)
        for i in range(0, len(metrics), BATCH):
            if self._call("logging metrics", self._client.log_batch, self.run_id,
                          metrics=metrics[i:i + BATCH]) is None and not self.on:
                return

    def log_files(self, paths, artifact_path: str | None = None) -> None:
        for path in paths:
            if Path(path).is_file() and self.on:
                self._call(f"uploading {Path(path).name}", self._client.log_artifact,
                           self.run_id, str(path), artifact_path)

    def record(self) -> dict:
        """``summary.json``'s ``mlflow`` entry (empty when tracking is off)."""
        if self.settings is None:
            return {}
        self.ensure_run()
        entry = {"tracking_uri": self.settings.tracking_uri,
                 "experiment": self.settings.experiment, "experiment_id": self.experiment_id,
                 "run_id": self.run_id, "run_name": self.settings.run_name,
                 "url": run_url(self.settings.tracking_uri, self.experiment_id, self.run_id),
                 "logged": self.error is None}
        if self.error:
            entry["error"] = self.error
        return {"mlflow": entry}

    # ------------------------------------------------------------------ the end

    def watch(self, logger: Logger, resumed: bool, **tags) -> Logger:
        """``logger`` with MLflow beside it (``logger`` itself when tracking is off)."""
        if self.settings is None:
            return logger
        self.resumed = resumed
        self.tags.update({k: str(v) for k, v in tags.items()})
        return MlflowLogger(logger, self)

    def finish(self, summary: dict | None) -> None:
        """After ``summary.json``: the best scores, ``summary.json``'s ``mlflow`` entry, the
        run's files, and the end."""
        if self.settings is None:
            return
        if self.ensure_run():
            from mlflow.entities import Metric

            self.backfill()
            best = (summary or {}).get("best") or {}
            now = int(time.time() * 1000)
            self.log_metrics([Metric(metric_key(f"best/{k}"), float(v), now,
                                     int(best["step"]))
                              for k, v in (best.get("metrics") or {}).items()])
        amend_summary(self.folder, self.record())
        files = ["config.yaml", "history.jsonl", "metrics.json", "summary.json"]
        if self.settings.log_models:
            files.append("best.tar")
        self.log_files(self.folder / name for name in files)
        if self.on:
            self._call("ending the run", self._client.set_terminated, self.run_id, "FINISHED")
        if self.error:  # the upload failed after the entry was written: it says so now
            amend_summary(self.folder, self.record())

    def stopped(self, error: BaseException) -> None:
        """The attempt failed or was preempted: mark the MLflow run; delete it when the run
        folder was taken back (no checkpoint was ever written)."""
        if self.run_id is None or not self.on:
            return
        if not (self.folder / STATE).exists():
            self._call("deleting the run", self._client.delete_run, self.run_id)
            return
        from echelon3.distributed.preemption import Preempted

        status = "KILLED" if isinstance(error, Preempted | KeyboardInterrupt) else "FAILED"
        self._call("ending the run", self._client.set_terminated, self.run_id, status)


def amend_summary(folder: Path, entry: dict) -> None:
    """``entry`` into the folder's ``summary.json`` (rewritten atomically)."""
    path = folder / "summary.json"
    if path.is_file():
        summary = json.loads(path.read_text())
        summary.update(entry)
        atomic_write_text(path, json.dumps(summary, indent=2) + "\n")


class MlflowLogger(Relay):
    """The run's own logger first (the source of truth), then MLflow, in bursts (see
    :class:`echelon3.observe.loggers.Relay`). ``rewind`` reaches only the run's own logger:
    MLflow cannot delete points, and the tracker sends no step it already holds."""


def for_task(rc, task: str = "train", folder: Path | None = None) -> Tracker:
    """The tracker of a task: off unless the ``mlflow`` key is set, and on every rank but 0."""
    from echelon3.distributed.ranks import is_main

    cfg = rc.cfg
    folder = Path(folder or str(cfg.target.path))
    on = settings(cfg, getattr(rc, "config_file", None)) if is_main() else None
    config = OmegaConf.to_container(cfg, resolve=True) if on is not None and task == "train" \
        else None
    return Tracker(on, folder, config, task=task)


def checkpoint_step(folder: Path, checkpoint: str | None) -> int:
    """The global step of the checkpoint that evaluate scored."""
    import torch

    from echelon3.checkpoints.files import CheckpointManager

    path = CheckpointManager(folder).for_inference(checkpoint)
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return int(state.get("global_step", 0))


def log_evaluation(rc, results: dict, checkpoint: str | None, output: Path | None) -> None:
    """``evaluate``'s metrics (``test/<name>``, at the scored checkpoint's step) and its
    JSON file, into the training run (a new run when training was not tracked)."""
    tracker = for_task(rc, "evaluate")
    if tracker.settings is None or not tracker.ensure_run():
        return
    from mlflow.entities import Metric

    step = checkpoint_step(tracker.folder, checkpoint)
    now = int(time.time() * 1000)
    tracker.log_metrics([Metric(metric_key(f"test/{k}"), float(v), now, step)
                         for k, v in results.items() if isinstance(v, int | float)])
    if output is not None:
        tracker.log_files([output])


def log_exported(rc, paths) -> None:
    """``export``'s files into the training run, when ``mlflow.log_models`` asks for them."""
    tracker = for_task(rc, "export")
    if tracker.settings is None or not tracker.settings.log_models:
        return
    if tracker.ensure_run():
        tracker.log_files(paths, "model")


__all__ = ["MlflowLogger", "Settings", "Tracker", "check", "for_task", "log_evaluation",
           "log_exported", "settings", "STATE"]
