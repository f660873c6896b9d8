"""The DDP loop a researcher writes by hand, for the DDP row of ``workloads.py``.

    torchrun --standalone --nproc_per_node 2 benchmarks/handwritten_ddp.py OUT_DIR [--smoke]
        [--find-unused]

gloo on the CPU, DistributedDataParallel with its defaults (``--find-unused``:
``find_unused_parameters=True``, echelon3's default), ``no_sync`` on every
micro-batch of an accumulation window but the last, gradient clipping, AdamW and a
per-epoch scheduler. The same seeds and data order as ``echelon3 train`` with
``nproc: 2`` (seed, build the network, re-seed with seed + rank; a DistributedSampler
per rank), validation sharded by stride and summed over the ranks, rank 0 saving a
checkpoint per epoch. ``OUT_DIR/checkpoint-<epoch>.tar`` mtimes give the per-epoch
times; ``OUT_DIR/final.json`` the last validation.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.handwritten import make, make_metrics, seed  # noqa: E402
from benchmarks.workloads import ddp_workload  # noqa: E402


def main(argv: list[str]) -> None:
    out, w = Path(argv[0]), ddp_workload(smoke="--smoke" in argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    accum = w.trainer_extra["grad_accum_steps"]
    clip = w.trainer_extra["gradient_clip_val"]
    seed(0)
    train_set = make(w.data)
    test_set = make(dict(w.data, config=dict(w.data["config"], split="test",
                                             size=w.test_size)))
    net = make(w.net)
    seed(rank)
    model = DistributedDataParallel(net, find_unused_parameters="--find-unused" in argv)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True,
                                 seed=0, drop_last=w.drop_last)
    train_loader = DataLoader(train_set, batch_size=w.batch_size // world, sampler=sampler,
                              drop_last=w.drop_last, generator=torch.Generator().manual_seed(0))
    shard = Subset(test_set, range(rank, len(test_set), world))
    test_loader = DataLoader(shard, batch_size=w.test_batch_size // world)
    criterion = torch.nn.CrossEntropyLoss()
    metrics = make_metrics(w.metrics, torch.device("cpu"))
    optimizer = make(w.optimizer, params=model.parameters())
    scheduler = make(w.scheduler, optimizer=optimizer)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    steps = len(train_loader)
    for epoch in range(w.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (x, y) in enumerate(train_loader):
            last = (i + 1) % accum == 0 or i + 1 == steps
            with contextlib.nullcontext() if last else model.no_sync():
                loss = criterion(model(x), y) * (1.0 / accum)
                loss.backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        results = validate(model, test_loader, criterion, metrics)
        if rank == 0:
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch + 1},
                       out / f"checkpoint-{epoch + 1}.tar")
    if rank == 0:
        (out / "final.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@torch.no_grad()
def validate(model, loader, criterion, metrics) -> dict[str, float]:
    model.eval()
    for metric in metrics.values():
        metric.reset()
    total = torch.zeros(2, dtype=torch.float64)
    for x, y in loader:
        pred = model.module(x)
        total[0] += criterion(pred, y).double() * len(y)
        total[1] += len(y)
        for metric in metrics.values():
            metric.update(pred, y)
    dist.all_reduce(total)
    results = {"loss": (total[0] / total[1]).item()}
    results.update({k: float(m.compute()) for k, m in metrics.items()})
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
