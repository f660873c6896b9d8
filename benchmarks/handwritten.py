"""The loop a researcher writes by hand, for one workload of ``workloads.py``.

    python benchmarks/handwritten.py "<workload name>" OUT_DIR [--smoke]

Same seeds and the same order of random draws as ``echelon3 train`` (seed, build
the network, re-seed; a DistributedSampler of one replica for the data order),
so in fp32 both reach the same loss. Per epoch: train, step the scheduler,
validate (loss and metrics), save a checkpoint. ``OUT_DIR/checkpoint-<epoch>.tar``
mtimes give the per-epoch times; ``OUT_DIR/final.json`` the last validation and
the process CPU time at the end of each epoch.
"""

from __future__ import annotations

import importlib
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import workloads  # noqa: E402


def seed(value: int) -> None:
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def make(spec: dict, **extra):
    return getattr(importlib.import_module(spec["module"]), spec["type"])(
        **spec.get("config", {}), **extra)


def make_metrics(names, device):
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

    known = {"accuracy": lambda: MulticlassAccuracy(num_classes=10, average="micro"),
             "macro_f1": lambda: MulticlassF1Score(num_classes=10, average="macro")}
    return {name: known[name]().to(device) for name in names}


def main(argv: list[str]) -> None:
    name, out = argv[0], Path(argv[1])
    w = workloads(smoke="--smoke" in argv)[name]
    device = torch.device("cuda" if w.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    seed(0)
    net = make(w.net).to(device)
    train_set = make(w.data)
    test_cfg = dict(w.data["config"], split="test", **({"size": w.test_size}
                                                         if w.test_size else {}))
    test_set = make(dict(w.data, config=test_cfg))
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=0,
                                 drop_last=w.drop_last)
    loader_args = dict(num_workers=w.num_workers, pin_memory=w.pin_memory)
    if w.num_workers:
        loader_args.update(prefetch_factor=2, multiprocessing_context="fork")
    # The loader's own generator draws its workers' base seed, as echelon3's train loader.
    train_loader = DataLoader(train_set, batch_size=w.batch_size, sampler=sampler,
                              drop_last=w.drop_last, generator=torch.Generator().manual_seed(0),
                              **loader_args)
    test_loader = DataLoader(test_set, batch_size=w.test_batch_size, **loader_args)
    criterion = torch.nn.CrossEntropyLoss()
    metrics = make_metrics(w.metrics, device)
    optimizer = make(w.optimizer, params=net.parameters())
    scheduler = make(w.scheduler, optimizer=optimizer)
    dtype = torch.bfloat16 if w.precision == "bf16" else None
    seed(0)
    out.mkdir(parents=True, exist_ok=True)
    cpu: list[float] = []  # process CPU seconds at the end of each epoch
    for epoch in range(w.epochs):
        sampler.set_epoch(epoch)
        net.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = criterion(net(x), y)
            loss.backward()
            optimizer.step()
        scheduler.step()
        results = validate(net, test_loader, criterion, metrics, device, dtype)
        torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch + 1},
                   out / f"checkpoint-{epoch + 1}.tar")
        cpu.append(time.process_time())
    (out / "final.json").write_text(json.dumps(dict(results, cpu_at_epoch_end=cpu)))


@torch.no_grad()
def validate(net, loader, criterion, metrics, device, dtype) -> dict[str, float]:
    net.eval()
    for metric in metrics.values():
        metric.reset()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            pred = net(x)
            total[0] += criterion(pred, y).double() * len(y)
        total[1] += len(y)
        for metric in metrics.values():
            metric.update(pred.float(), y)
    results = {"loss": (total[0] / total[1]).item()}
    results.update({k: float(m.compute()) for k, m in metrics.items()})
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
