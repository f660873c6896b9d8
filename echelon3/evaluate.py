"""``echelon3 evaluate``: a checkpoint's metrics over the test set(s), as a flat JSON file.

:func:`evaluate_sets` is also the trainer's validation loop, so validation and
evaluation compute exactly the same numbers. Under DDP every rank runs its own
shard (no sample counted twice) and metrics reduce across ranks.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from tqdm import tqdm  # not tqdm.auto: its asyncio variant opens every loader twice

from echelon3.checkpoint import atomic_write_text
from echelon3.dist import all_reduce_sum_, is_main
from echelon3.samples import naming_bad_labels

log = logging.getLogger(__name__)


def split_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    if isinstance(batch, Sequence) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping) and {"input", "target"} <= set(batch):
        return batch["input"], batch["target"]
    raise TypeError("a batch must be (input, target) or a mapping with 'input' and 'target'")


def to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Mapping):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_device(v, device) for v in value)
    return value


def match_target(pred: torch.Tensor, target: torch.Tensor, float_labels: bool = False):
    """Squeeze trailing singleton dims of ``pred`` down to ``target``'s rank."""
    while pred.dim() > target.dim() and pred.shape[-1] == 1:
        pred = pred.squeeze(-1)
    return pred, (target.float() if float_labels else target)


def weighted_loss(losses: Mapping, pred, target, float_labels: bool = False):
    """Σ weight · loss(pred, target) -> (total, {name: part})."""
    pred, target = match_target(pred, target, float_labels)
    parts, total = {}, None
    for name, (fn, weight) in losses.items():
        parts[name] = part = fn(pred, target)
        term = part if weight == 1 else weight * part  # no extra kernel for weight 1
        total = term if total is None else total + term
    return total, parts


def metric_name(test_set: str, metric: str, named_sets: bool) -> str:
    return f"{test_set}/{metric}" if named_sets else metric


@torch.no_grad()
def evaluate_sets(net, loaders: Mapping, metrics: Mapping, *, precision, device,
                  losses: Mapping | None = None, named_sets: bool = False,
                  metric_sets: Sequence[str] | None = None, float_labels: bool = False,
                  progress: bool = True) -> dict[str, float]:
    """Loss (when losses are given) and metrics per test set, identical on every rank."""
    from echelon3.metrics.base import reduce_and_compute

    metric_sets = list(loaders) if metric_sets is None else metric_sets
    was_training = net.training
    net.eval()
    results: dict[str, float] = {}
    for set_name, loader in loaders.items():
        with_metrics = set_name in metric_sets
        for metric in metrics.values():
            metric.reset()
        loss_sum = torch.zeros(2, dtype=torch.float64, device=device)
        for batch in tqdm(loader, desc=f"evaluate {set_name}", leave=False,
                          disable=None if progress and is_main() else True):
            with naming_bad_labels(batch, metrics):
                inputs, target = to_device(split_batch(batch), device)
                with precision.autocast():
                    pred = net(inputs)
                    if losses:
                        total, _ = weighted_loss(losses, pred, target, float_labels)
                        loss_sum[0] += total.double() * len(target)
                loss_sum[1] += len(target)
                if with_metrics:
                    pred, target = match_target(pred.float(), target, float_labels)
                    for metric in metrics.values():
                        metric.update(pred, target)
        if losses:
            all_reduce_sum_(loss_sum)
            results[metric_name(set_name, "loss", named_sets)] = (
                loss_sum[0] / loss_sum[1].clamp(min=1)).item()
        if with_metrics:
            for name, metric in metrics.items():
                results[metric_name(set_name, name, named_sets)] = reduce_and_compute(metric)
    net.train(was_training)
    return results


class Evaluator:
    """The built-in ``evaluator``: injects ``path=`` (target.path).

    ``checkpoint``: file to load (default best.tar, else the newest rolling one);
    ``output``: the JSON file (default ``<target.path>/metrics.json``);
    ``metrics_on``: named test sets to compute metrics on (default all);
    ``float_labels``: cast labels to float (default: ``trainer.config.float_labels``).

    The JSON holds the metrics and ``selected_on``: the data whose validation chose the
    checkpoint (``val``, or ``test`` when the test set chose it too), as its run recorded.
    """

    def __init__(self, path: str, checkpoint: str | None = None, output: str | None = None,
                 metrics_on: str | Sequence[str] | None = None,
                 float_labels: bool | None = None):
        self.path = Path(path)
        self.checkpoint = checkpoint
        self.output = Path(output) if output else self.path / "metrics.json"
        self.metrics_on = [metrics_on] if isinstance(metrics_on, str) else metrics_on
        self.float_labels = float_labels

    def selected_on(self) -> str:
        """``val`` or ``test``: what the evaluated checkpoint records (older ones: ``test``)."""
        from echelon3.checkpoint import CheckpointManager
        from echelon3.splits import TEST

        path = CheckpointManager(self.path).for_inference(self.checkpoint)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return str(state.get("selected_on") or TEST)

    def __call__(self, *, net, test_loaders, metrics, losses, precision, device,
                 named_sets) -> dict[str, float]:
        from echelon3.splits import describe

        results = evaluate_sets(net, test_loaders, metrics, precision=precision, device=device,
                                losses=losses, named_sets=named_sets,
                                metric_sets=self.metrics_on, float_labels=self.float_labels)
        if is_main():
            selected = self.selected_on()
            atomic_write_text(self.output, json.dumps({**results, "selected_on": selected},
                                                      indent=2, sort_keys=True) + "\n")
            width = max((len(k) for k in results), default=6)
            table = "\n".join(f"  {k:<{width}}  {v:.4f}" for k, v in results.items())
            log.info("test metrics, checkpoint %s (written to %s):\n%s", describe(selected),
                     self.output, table)
        return results


def evaluate(rc, device, launcher) -> None:
    from echelon3 import build
    from echelon3.config import require
    from echelon3.data import create_dataloaders
    from echelon3.tasks import load_for_inference, seed_everything

    cfg = rc.cfg
    require(cfg, "net", "data", "dataloaders", "target", task="evaluate")
    seed_everything(int(cfg.get("seed", 0)))
    spec = build.with_default_type(cfg.get("evaluator"), "evaluator", "echelon3.evaluate",
                                   "Evaluator")
    evaluator = build.instantiate(spec, "evaluator", rc.config_dir, path=cfg.target.path)
    # Everything the config can get wrong is built before the checkpoint is read.
    metrics = build.build_metrics(cfg, rc.config_dir, device=device)
    losses = build.build_losses(cfg, rc.config_dir, required=False, device=device)
    _, tests, named = build.build_datasets(cfg, rc.config_dir, train=False)
    _, loaders = create_dataloaders(cfg.dataloaders, None, tests, rank=launcher.rank,
                                    world_size=launcher.world_size, seed=cfg.get("seed", 0),
                                    config_dir=rc.config_dir)
    if getattr(evaluator, "float_labels", False) is None:  # as the model was trained
        trainer = (cfg.get("trainer") or {}).get("config") or {}
        evaluator.float_labels = bool(trainer.get("float_labels", False))
    net, precision = load_for_inference(rc, device, getattr(evaluator, "checkpoint", None))
    evaluator(net=net, test_loaders=loaders, metrics=metrics, losses=losses,
              precision=precision, device=device, named_sets=named)
