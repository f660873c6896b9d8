"""Validation and evaluation compute the same numbers: :func:`evaluate_sets`.

The trainer validates through it and ``echelon3 evaluate`` scores a checkpoint
through it. Under DDP every rank runs its own shard (no sample counted twice)
and metrics reduce across ranks. A network may return a mapping of outputs; losses and
metrics then read their entry (``input_key``, :mod:`echelon3.data.batches`). Under
``loss: from_output`` the network is called with the target, the loss is its own
(weighted by samples like any other) and the metrics see its logits.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from tqdm import tqdm  # not tqdm.auto: its asyncio variant opens every loader twice

from echelon3.config.errors import blame
from echelon3.data.batches import (batch_size, call_net, match_target, predictions, raise_named,
                                   split_batch, to_device, weighted_loss)
from echelon3.data.samples import naming_bad_labels
from echelon3.distributed.ranks import all_reduce_sum_, is_main, unwrap


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
    module = unwrap(net)  # whose forward says how it takes the target (loss: from_output)
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
                    try:
                        out = call_net(net, module, losses, inputs, target)
                    except Exception as e:
                        blame(e, "net")
                        raise
                    if losses:
                        total, _ = weighted_loss(losses, out, target, float_labels)
                        loss_sum[0] += total.double() * batch_size(target)
                loss_sum[1] += batch_size(target)
                if with_metrics and metrics:
                    pred = as_float(predictions(losses, out))
                    update(metrics, *match_target(pred, target, float_labels))
        if losses:
            all_reduce_sum_(loss_sum)
            results[metric_name(set_name, "loss", named_sets)] = (
                loss_sum[0] / loss_sum[1].clamp(min=1)).item()
        if with_metrics:
            for name, metric in metrics.items():
                try:
                    results[metric_name(set_name, name, named_sets)] = reduce_and_compute(metric)
                except Exception as e:
                    blame(e, f"metrics.{name}")
                    raise
    net.train(was_training)
    return results


def as_float(pred):
    """The network's output (a tensor, or a mapping of them) in float32 for the metrics."""
    if isinstance(pred, torch.Tensor):
        return pred.float()
    if isinstance(pred, Mapping):
        return {k: as_float(v) for k, v in pred.items()}
    return pred


def update(metrics: Mapping, pred, target) -> None:
    for name, metric in metrics.items():
        try:
            metric.update(pred, target)
        except Exception as e:
            raise_named(f"metrics.{name}", pred, metric, e)
