"""``echelon3 evaluate``: a checkpoint's metrics over the test set(s), as a flat JSON file.

The numbers come from :func:`echelon3.trainers.evaluation.evaluate_sets`, the trainer's
validation loop, so validation and evaluation compute exactly the same numbers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

from echelon3.checkpoints.files import atomic_write_text
from echelon3.distributed.ranks import is_main
from echelon3.trainers.evaluation import evaluate_sets

log = logging.getLogger(__name__)


class Evaluator:
    """The built-in ``evaluator``: injects ``path=`` (target.path).

    ``checkpoint``: file to load (default best.tar, else the newest rolling one);
    ``output``: the JSON file (default ``<target.path>/metrics.json``);
    ``metrics_on``: named test sets to compute metrics on (default all);
    ``float_labels``: cast labels to float (default: ``trainer.config.float_labels``).

    The JSON holds the metrics and, for the checkpoint keep-best chose (``best.tar``, or a
    rolling checkpoint that is the same file), ``selected_on``: the data whose validation
    chose it (``val``, or ``test`` when the test set chose it too), as its run recorded. A
    rolling checkpoint no validation chose has no ``selected_on``.
    """

    def __init__(self, path: str, checkpoint: str | None = None, output: str | None = None,
                 metrics_on: str | Sequence[str] | None = None,
                 float_labels: bool | None = None):
        self.path = Path(path)
        self.checkpoint = checkpoint
        self.output = Path(output) if output else self.path / "metrics.json"
        self.metrics_on = [metrics_on] if isinstance(metrics_on, str) else metrics_on
        self.float_labels = float_labels

    def selected_on(self) -> str | None:
        """``val`` or ``test``: what the evaluated checkpoint records (older ones: ``test``);
        None for a rolling checkpoint that keep-best did not choose."""
        import os

        import torch

        from echelon3.checkpoints.files import BEST, KEPT_BEST, CheckpointManager
        from echelon3.data.splits import TEST

        path = CheckpointManager(self.path).for_inference(self.checkpoint)
        best = [self.path / name for name in (BEST, KEPT_BEST) if (self.path / name).exists()]
        if not any(os.path.samefile(path, chosen) for chosen in best):
            return None
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return str(state.get("selected_on") or TEST)

    def __call__(self, *, net, test_loaders, metrics, losses, precision, device,
                 named_sets) -> dict[str, float]:
        from echelon3.data.splits import describe

        results = evaluate_sets(net, test_loaders, metrics, precision=precision, device=device,
                                losses=losses, named_sets=named_sets,
                                metric_sets=self.metrics_on, float_labels=self.float_labels)
        if is_main():
            selected = self.selected_on()
            chosen = {"selected_on": selected} if selected is not None else {}
            atomic_write_text(self.output, json.dumps({**results, **chosen},
                                                      indent=2, sort_keys=True) + "\n")
            width = max((len(k) for k in results), default=6)
            table = "\n".join(f"  {k:<{width}}  {v:.4f}" for k, v in results.items())
            log.info("test metrics, checkpoint %s (written to %s):\n%s",
                     describe(selected) if selected else "chosen by no validation",
                     self.output, table)
        return results


def evaluate(rc, device, launcher) -> None:
    from echelon3.config import build
    from echelon3.config.compose import require
    from echelon3.data.loaders import create_dataloaders
    from echelon3.data.rng import seed_everything
    from echelon3.observe import mlflow, wandb
    from echelon3.tasks import components
    from echelon3.tasks.inference import load_for_inference

    cfg = rc.cfg
    require(cfg, "net", "data", "dataloaders", "target", task="evaluate")
    seed_everything(int(cfg.get("seed", 0)))
    spec = build.with_default_type(cfg.get("evaluator"), "evaluator", "echelon3.tasks.evaluate",
                                   "Evaluator")
    evaluator = build.instantiate(spec, "evaluator", rc.config_dir, path=cfg.target.path)
    # Everything the config can get wrong is built before the checkpoint is read.
    metrics = components.build_metrics(cfg, rc.config_dir, device=device)
    losses = components.build_losses(cfg, rc.config_dir, required=False, device=device)
    _, tests, named = components.build_datasets(cfg, rc.config_dir, train=False)
    _, loaders = create_dataloaders(cfg.dataloaders, None, tests, rank=launcher.rank,
                                    world_size=launcher.world_size, seed=cfg.get("seed", 0),
                                    config_dir=rc.config_dir)
    if getattr(evaluator, "float_labels", False) is None:  # as the model was trained
        trainer = (cfg.get("trainer") or {}).get("config") or {}
        evaluator.float_labels = bool(trainer.get("float_labels", False))
    net, precision = load_for_inference(rc, device, getattr(evaluator, "checkpoint", None))
    results = evaluator(net=net, test_loaders=loaders, metrics=metrics, losses=losses,
                        precision=precision, device=device, named_sets=named)
    if isinstance(results, dict):  # into the training run's MLflow / W&B run, when tracked
        mlflow.log_evaluation(rc, results, getattr(evaluator, "checkpoint", None),
                              getattr(evaluator, "output", None))
        wandb.log_evaluation(rc, results, getattr(evaluator, "checkpoint", None))
